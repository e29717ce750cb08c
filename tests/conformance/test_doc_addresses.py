"""The code names docs/glossary.md gives for spec, reference and impl exist: every dotted or
snake_case name in those columns is a module, class, function or attribute of ours (old names
in "(was ...)" and metric names excepted), so the glossary cannot keep a stale address."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[2]
CODE_COLUMNS = ("spec", "reference", "impl")


@cache
def defined_names() -> frozenset[str]:
    """Every module stem, class, function and assigned name or attribute in the four parts."""
    names: set[str] = set()
    for part in ("spec", "reference", "impl", "conformance"):
        for path in (ROOT / part).rglob("*.py"):
            names.add(path.stem)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, ast.AnnAssign) else [])
                for t in targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        names.add(t.attr)
    return frozenset(names)


def code_names(cell: str) -> list[str]:
    """The code names a glossary cell gives: backticked, dotted or with an underscore or a
    capital (plain words are prose); old names ("was ...") and metric names are skipped."""
    cell = re.sub(r"\(was [^)]*\)|\bwas `[^`]*`", "", cell)
    cell = re.sub(r"metrics? `[^`]*`(, `[^`]*`)*", "", cell)
    out = []
    for tok in re.findall(r"`([^`]+)`", cell):
        tok = tok.strip().removesuffix("()")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", tok):
            continue
        if "." in tok or "_" in tok or tok[0].isupper():
            out.append(tok)
    return out


def glossary_cells() -> list[tuple[int, str, str]]:
    """(line, column, cell) of every code column of every glossary table."""
    cols: list[str] | None = None
    out = []
    lines = (ROOT / "docs" / "glossary.md").read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            cols = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cols is None:
            cols = cells
            continue
        if line.startswith("|---"):
            continue
        out += [(n, col, cell) for col, cell in zip(cols, cells, strict=False)
                if col in CODE_COLUMNS]
    return out


def test_glossary_code_names_exist() -> None:
    names = defined_names()
    stale = [f"docs/glossary.md:{n} [{col}] {tok}" for n, col, cell in glossary_cells()
             for tok in code_names(cell) if any(p not in names for p in tok.split(".")
                                                if p != "py")]
    assert not stale, "names the code no longer has:\n" + "\n".join(stale)
