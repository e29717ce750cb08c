"""docs/architecture.md, "One save, walked", against the code, so the walk cannot go stale.

Every ``path:function`` address in docs/architecture.md names a file of the package and a
function or class defined in it (read with ``ast``: nothing is imported, no vLLM needed). The
walk's counts are those of one save traced with ``sys.setprofile`` through vLLM's real
``Scheduler`` (``engine_sim``: one full-attention group, the memory store, the extension off,
one rank, Model Runner V1): the functions of ``impl/`` and ``spec/`` that run under the save's
hooks, the cross-file calls among them and their files, by the rule the section states. Every
function the walk names runs in that save, except the alternatives it names for other set-ups
(:data:`NOT_RUN`). A change to the save path fails here until the doc says what it now does.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
from functools import cache
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## One save, walked"
ADDRESS = re.compile(r"`((?:impl|spec|reference|conformance)/[\w/]+\.py):([A-Za-z_][\w.]*)`")
COUNTS = re.compile(r"Now: \*\*(\d+) functions, (\d+) cross-file calls, (\d+) files\*\*")
#: The save's hooks (the outermost function of ours on each stack; the sender thread's loop
#: was entered before the trace began and is found through the frame chain).
HOOKS = frozenset({
    "TailproofConnector.build_connector_meta", "TailproofConnector.wait_for_save",
    "Lanes._loop", "TailproofConnector.build_connector_worker_meta",
    "TailproofConnector.update_connector_output",
})
#: Walk addresses of other set-ups, not run by the traced save: the Mooncake store's put and the
#: aggregation of several ranks' reports.
NOT_RUN = frozenset({
    "impl/stores/base.py:Store.write_batch", "impl/stores/mooncake.py:MooncakeStore.put_batch",
    "impl/meta.py:TailproofWorkerMeta.aggregate",
})
#: Comprehensions and lambdas are not counted: their calls are their enclosing function's.
_INNER = re.compile(r"(?:\.<locals>\.<(?:listcomp|genexpr|lambda|dictcomp|setcomp)>)+$")


def _section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


@cache
def _qualnames(path: str) -> frozenset[str]:
    """Qualified names of every class and function defined in ``path`` (nested ones too)."""
    out: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.add(name)
                inner = ".<locals>." if not isinstance(child, ast.ClassDef) else "."
                walk(child, name + inner)

    walk(ast.parse((ROOT / path).read_text()), "")
    return frozenset(out)


def test_every_address_in_architecture_md_resolves() -> None:
    addresses = ADDRESS.findall(DOC.read_text())
    assert len(ADDRESS.findall(_section())) >= 15, "the walk lost its addresses"
    missing = [f"{p}:{q}" for p, q in addresses
               if not (ROOT / p).is_file() or q not in _qualnames(p)]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_not_run_addresses_are_in_the_walk() -> None:
    """:data:`NOT_RUN` names addresses the walk still has."""
    walk = {f"{p}:{q}" for p, q in ADDRESS.findall(_section())}
    assert NOT_RUN <= walk, sorted(NOT_RUN - walk)


class _Tracer:
    """A profile function: per thread, the stack of our functions; every call recorded as
    (the stack's outermost function, caller, callee), comprehensions folded into their
    enclosing function."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = {str(d.resolve()) + os.sep: d.name for d in dirs}
        self.on = False
        self.stacks: dict[int, list[tuple[str, str]]] = {}
        self.calls: set[tuple[tuple[str, str], tuple[str, str] | None, tuple[str, str]]] = set()
        self._names: dict[CodeType, tuple[str, str] | None] = {}

    def _name(self, code: CodeType) -> tuple[str, str] | None:
        if code not in self._names:
            name = None
            for d, part in self.dirs.items():
                if code.co_filename.startswith(d):
                    rel = part + "/" + code.co_filename[len(d):].replace(os.sep, "/")
                    name = (rel, _INNER.sub("", code.co_qualname))
            self._names[code] = name
        return self._names[code]

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        name = self._name(frame.f_code)
        if name is None:
            return
        stack = self.stacks.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack:
                stack.pop()
            return
        if not stack:  # frames of ours entered before the trace began (a thread's loop)
            f, outer = frame.f_back, []
            while f is not None and (n := self._name(f.f_code)) is not None:
                outer.append(n)
                f = f.f_back
            stack.extend(reversed(outer))
            for i, n in enumerate(stack):
                self.calls.add((stack[0], stack[i - 1] if i else None, n))
        self.calls.add((stack[0] if stack else name, stack[-1] if stack else None, name))
        stack.append(name)


@pytest.mark.vllm
def test_walk_counts_are_those_of_a_traced_save() -> None:
    pytest.importorskip("vllm")
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_sim import Engine

    import tailproof.impl
    import tailproof.spec

    tracer = _Tracer([Path(tailproof.impl.__file__).parent, Path(tailproof.spec.__file__).parent])
    threading.setprofile(tracer)  # the sender threads the engine starts
    try:
        e = Engine({"store": "memory", "namespace": "architecture-walk",
                    "capacity_bytes": 1 << 24},
                   groups=(("full_attention", 16),), h=16, model_runner="v1")
    finally:
        threading.setprofile(None)  # (threads started keep it; it records only while on)
    try:
        e.add("a", list(range(10, 42)), max_tokens=1)  # 32 tokens: two blocks, one save
        sys.setprofile(tracer)
        tracer.on = True
        try:
            log = e.step()
        finally:
            tracer.on = False
            sys.setprofile(None)
        assert len(log.stores) == 1 and e.conn.scheduler_side.held == {}, "not one whole save"
    finally:
        e.shutdown()
    calls = {(a, b) for root, a, b in tracer.calls if root[1] in HOOKS}
    functions = {b for _, b in calls}
    crossings = {(a, b) for a, b in calls if a is not None and a[0] != b[0]}
    files = {f for f, _ in functions}
    got = (len(functions), len(crossings), len(files))
    m = COUNTS.search(_section())
    assert m is not None, "the walk's counts line is missing"
    listing = "\n".join(f"{f}:{q}" for f, q in sorted(functions))
    assert tuple(map(int, m.groups())) == got, (
        f"the save now runs {got[0]} functions, {got[1]} cross-file calls, {got[2]} files: "
        f"update docs/architecture.md ({SECTION[3:]}):\n{listing}")
    walk = {f"{p}:{q}" for p, q in ADDRESS.findall(_section())
            if p.startswith(("impl/", "spec/")) and not _is_class(p, q)}
    ran = {f"{f}:{q}" for f, q in functions}
    assert walk - NOT_RUN <= ran, f"the walk names what the save does not run: {walk - ran}"


def _is_class(path: str, qualname: str) -> bool:
    """Whether ``qualname`` in ``path`` is a class (a record the walk names, not a call)."""
    tree = ast.parse((ROOT / path).read_text())
    node: Any = tree
    for part in qualname.split("."):
        node = next((c for c in ast.iter_child_nodes(node)
                     if isinstance(c, (ast.ClassDef, ast.FunctionDef)) and c.name == part), None)
        if node is None:
            return False
    return isinstance(node, ast.ClassDef)
