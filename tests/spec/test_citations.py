"""docs/citations.md against the installed vLLM release: every file tag used in the repository
is defined there, every cited line exists, the index of cited functions gives each function's
exact lines, and each statement range lies inside the function it names (read with ``ast``,
without importing vLLM).

A range names its release: ``MS:304-525`` is vLLM 0.33, ``MS@0.34:322-505`` vLLM 0.34. Each
check runs once per release and checks that release's citations against its installed files;
the release that is not installed is skipped, by name (``make test`` runs both). Where both
source trees are on disk, the two columns of each statement range must cite the same code
unless the row says what changed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
import sysconfig
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "citations.md"
#: A range without a release is one of vLLM 0.33.0 (every range written before 0.34).
DEFAULT = "0.33"
RELEASES = ("0.33", "0.34")
CITATION = re.compile(r"\b([A-Z]{2,3})(?:@(\d+\.\d+))?:(\d+)(?:-(\d+))?\b")
SEARCHED = ("*.py", "*.md", "*.json")
SKIPPED = {".git", "build", ".devpack"}  # and every virtual environment (.venv, .venv-device, ...)
GONE = "—"
MODULE = "(module)"

Cite = tuple[str, str, int, int]  # (tag, release, first line, last line)


def _parse(text: str) -> Cite:
    m = CITATION.fullmatch(text)
    assert m, f"not a citation: {text!r}"
    lo = int(m.group(3))
    return m.group(1), m.group(2) or DEFAULT, lo, int(m.group(4) or lo)


def _text(c: Cite) -> str:
    tag, rel, lo, hi = c
    return f"{tag}{'' if rel == DEFAULT else '@' + rel}:{lo}" + (f"-{hi}" if hi != lo else "")


def _release(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _installed() -> tuple[str, Path] | None:
    """The release vLLM imports as here (the overlay of ``scripts/vllm_env.sh`` first) and the
    folder holding its ``vllm`` package."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return (_release(importlib.metadata.version("vllm")),
            Path(next(iter(spec.submodule_search_locations))).parent)


@cache
def _source_trees() -> dict[str, Path]:
    """Every vLLM release whose source is on disk: the venv's own and each overlay folder."""
    found: dict[str, Path] = {}
    for folder in [*map(Path, sys.path), Path(sysconfig.get_paths()["purelib"]),
                   *ROOT.glob(".venv-vllm*")]:
        if not (folder / "vllm" / "__init__.py").is_file():
            continue
        for dist in folder.glob("vllm-*.dist-info"):
            found.setdefault(_release(dist.name[len("vllm-"):-len(".dist-info")]), folder)
    return found


def _root(release: str) -> Path:
    """The installed release's site folder; skips, naming it, when ``release`` is another."""
    inst = _installed()
    if inst is None:
        pytest.skip(f"vLLM {release} is not installed (no vLLM at all)")
    if inst[0] != release:
        pytest.skip(f"vLLM {release} is not the installed release ({inst[0]}); run with "
                    f"PYTHONPATH=$(scripts/vllm_env.sh {release})")
    return inst[1]


def _table(heading: str) -> list[list[str]]:
    """The rows of the first markdown table under ``heading`` (cells stripped of backticks)."""
    text = DOC.read_text().split(heading, 1)[1]
    rows = []
    for line in text.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows[1:]


def _tags() -> dict[str, str]:
    return {tag: path for tag, path in _table("### File abbreviations")}


def _index() -> list[tuple[str, dict[str, Cite]]]:
    """(function, {release: its range}) per row of the index; a release without it is absent."""
    rows = _table("### Index of cited functions")
    assert rows and len(rows[0]) == 1 + len(RELEASES), rows[:1]
    return [(name, {rel: _parse(cell) for rel, cell in zip(RELEASES, cells, strict=True)
                    if cell != GONE}) for name, *cells in rows]


def _statements() -> list[tuple[dict[str, Cite], dict[str, str], str]]:
    """Per row of the statement table: {release: range}, {release: enclosing definition},
    and what changed (empty: the same code in both)."""
    out = []
    for *cells, inside, changed in _table("### Statement ranges in both releases"):
        names = [n.strip().strip("`") for n in inside.split("→")]
        names += names[-1:] * (len(RELEASES) - len(names))
        out.append(({rel: _parse(c) for rel, c in zip(RELEASES, cells, strict=True)
                     if c != GONE}, dict(zip(RELEASES, names, strict=True)), changed))
    return out


def _repo_citations() -> list[tuple[Path, Cite]]:
    out = []
    for pattern in SEARCHED:
        for f in ROOT.rglob(pattern):
            parts = f.relative_to(ROOT).parts
            if SKIPPED & set(parts) or any(p.startswith(".venv") for p in parts):
                continue
            for m in CITATION.finditer(f.read_text(errors="replace")):
                out.append((f, _parse(m.group(0))))
    return out


def _definitions(path: Path) -> dict[str, tuple[int, int]]:
    """Qualified name -> (first line incl. decorators, last line) of every def and class."""
    out: dict[str, tuple[int, int]] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([n.lineno] + [d.lineno for d in n.decorator_list])
                out[prefix + n.name] = (first, n.end_lineno or n.lineno)
                walk(n, f"{prefix}{n.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


def _lookup(defs: dict[str, tuple[int, int]], name: str) -> tuple[int, int] | None:
    """``name``'s lines: an exact qualified name, else the one definition ending in it."""
    found = [q for q in defs if q == name or q.endswith("." + name)]
    return defs.get(found[0] if len(found) == 1 else name)


def test_every_tag_and_release_used_is_defined() -> None:
    tags = _tags()
    undefined = sorted({f"{f.relative_to(ROOT)}: {_text(c)}" for f, c in _repo_citations()
                        if c[0] not in tags or c[1] not in RELEASES})
    assert not undefined


def test_every_033_range_has_its_034_counterpart() -> None:
    """A 0.33 range cited anywhere is a function of the index or a row of the statement
    table, so its 0.34 lines (or their absence) are written down next to it."""
    known = {c[DEFAULT] for _, c in _index() if DEFAULT in c}
    known |= {c[DEFAULT] for c, _, _ in _statements() if DEFAULT in c}
    missing = sorted({f"{f.relative_to(ROOT)}: {_text(c)}" for f, c in _repo_citations()
                      if c[1] == DEFAULT and c not in known})
    assert not missing, ("add each to docs/citations.md (the index or the statement table) "
                         f"with its 0.34 lines: {missing}")


@pytest.mark.parametrize("release", RELEASES)
def test_every_cited_line_exists(release: str) -> None:
    root, tags = _root(release), _tags()
    lengths = {t: len((root / p).read_text().splitlines()) for t, p in tags.items()}
    bad = [f"{f.relative_to(ROOT)}: {_text(c)}" for f, c in _repo_citations()
           if c[1] == release and c[0] in lengths and not 1 <= c[2] <= c[3] <= lengths[c[0]]]
    assert not bad


@pytest.mark.parametrize("release", RELEASES)
def test_function_index_matches_installed_vllm(release: str) -> None:
    root, tags = _root(release), _tags()
    defs = {t: _definitions(root / p) for t, p in tags.items()}
    rows = _index()
    assert sum(release in c for _, c in rows) > 30
    wrong = []
    for name, cites in rows:
        c = cites.get(release)
        got = [_lookup(d, name) for d in defs.values()]
        if c is None:  # not in this release: no definition of that name in any tagged file
            if any(got):
                wrong.append(f"{name}: cited as absent from {release}, installed {got}")
        elif _lookup(defs[c[0]], name) != (c[2], c[3]):
            wrong.append(f"{name}: cited {_text(c)}, installed {_lookup(defs[c[0]], name)}")
    assert not wrong


@pytest.mark.parametrize("release", RELEASES)
def test_statement_ranges_lie_in_their_function(release: str) -> None:
    root, tags = _root(release), _tags()
    defs = {t: _definitions(root / p) for t, p in tags.items()}
    lengths = {t: len((root / p).read_text().splitlines()) for t, p in tags.items()}
    wrong = []
    for cites, inside, _ in _statements():
        c = cites.get(release)
        if c is None:
            continue
        name = inside[release]
        lo, hi = (1, lengths[c[0]]) if name == MODULE else (_lookup(defs[c[0]], name)
                                                             or (0, -1))
        if not lo <= c[2] <= c[3] <= hi:
            wrong.append(f"{_text(c)}: not inside {name} ({lo}-{hi})")
    assert not wrong


def test_counterparts_cite_the_same_code() -> None:
    """Both releases' source trees on disk (the venv's own and the overlay): each statement
    row without a note cites the same lines in both (indentation aside), and each row with
    one cites different lines."""
    trees, tags = _source_trees(), _tags()
    absent = [r for r in RELEASES if r not in trees]
    if absent:
        pytest.skip(f"vLLM {', '.join(absent)} not on disk (scripts/bootstrap.sh installs it)")

    def lines(c: Cite) -> list[str]:
        text = (trees[c[1]] / tags[c[0]]).read_text().splitlines()
        return [x.strip() for x in text[c[2] - 1:c[3]]]

    wrong = []
    for cites, _, changed in _statements():
        if len(cites) < len(RELEASES):
            continue
        a, b = (lines(cites[r]) for r in RELEASES)
        if (a == b) == bool(changed):
            wrong.append(f"{' / '.join(_text(c) for c in cites.values())}: "
                         + ("the note says it changed; the lines are the same" if changed
                            else "the lines differ; say what changed"))
    assert not wrong
