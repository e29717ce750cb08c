"""docs/citations.md against the installed vLLM 0.33.0: every file tag used in the repository
is defined there, every cited line exists, and the index of cited functions gives each
function's exact lines (read with ``ast``, without importing vLLM)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "citations.md"
CITATION = re.compile(r"\b([A-Z]{2,3}):(\d+)(?:-(\d+))?\b")
SEARCHED = ("*.py", "*.md", "*.json")
SKIPPED = {".git", "build", ".devpack"}  # and every virtual environment (.venv, .venv-device, ...)


def _vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM 0.33 not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


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


def _repo_citations() -> list[tuple[Path, str, int, int]]:
    out = []
    for pattern in SEARCHED:
        for f in ROOT.rglob(pattern):
            parts = f.relative_to(ROOT).parts
            if SKIPPED & set(parts) or any(p.startswith(".venv") for p in parts):
                continue
            for m in CITATION.finditer(f.read_text(errors="replace")):
                lo = int(m.group(2))
                out.append((f, m.group(1), lo, int(m.group(3) or lo)))
    return out


def test_every_tag_used_is_defined() -> None:
    tags = _tags()
    undefined = sorted({f"{f.relative_to(ROOT)}: {t}" for f, t, _, _ in _repo_citations()
                        if t not in tags})
    assert not undefined


def test_every_cited_line_exists() -> None:
    root, tags = _vllm_root(), _tags()
    lengths = {t: len((root / p).read_text().splitlines()) for t, p in tags.items()}
    bad = [f"{f.relative_to(ROOT)}: {t}:{lo}-{hi}" for f, t, lo, hi in _repo_citations()
           if t in lengths and not 1 <= lo <= hi <= lengths[t]]
    assert not bad


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


def test_function_index_matches_installed_vllm() -> None:
    root, tags = _vllm_root(), _tags()
    defs = {t: _definitions(root / p) for t, p in tags.items()}
    rows = _table("### Index of cited functions")
    assert len(rows) > 30
    wrong = []
    for name, lines in rows:
        m = CITATION.fullmatch(lines)
        assert m, lines
        tag, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        found = [q for q in defs[tag] if q == name or q.endswith("." + name)]
        if defs[tag].get(found[0] if len(found) == 1 else name) != (lo, hi):
            wrong.append(f"{name}: cited {lines}, installed {[defs[tag][q] for q in found]}")
    assert not wrong
