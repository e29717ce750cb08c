"""Author corpus cases (``conformance/cases/*.json``) as short scheduler scripts.

A ``Case`` is written with ``op`` (any trace op), ``add`` (a request) and ``step`` /
``prefill`` (whole engine steps, ``steps.py``). Two modules hold the scripts:
``scripts/author_core_cases.py`` (core cases, written without running: their expectations
are written from vLLM with ``tailproof expect`` and reviewed) and
``conformance/tools/authoring/conn_cases.py`` (connector cases, run while authored on vLLM 0.33 +
Mooncake and the reference in lockstep, strict block ids; vLLM's observations become the
expectations). Both end in ``main``:

    .venv/bin/python scripts/author_core_cases.py [--check] [--out DIR] [NAME ...]

A stored case that means the same as its script (same config, the same ops once normalised,
the same recorded expectations) is left as it is, and a core case keeps its reviewed
expectations while its ops are unchanged. ``--check`` writes nothing and exits 1 when a stored
case differs from its script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tailproof.conformance.format.trace import FORMAT_TAG, parse_trace
from tailproof.conformance.harness.lockstep import Lockstep
from tailproof.conformance.harness.steps import Observation, Op, Steps, op

CASES_DIR = Path(__file__).resolve().parents[2] / "cases"
FA, M = "full_attention", "mamba_align"
Group = tuple[str, int] | tuple[str, int, bool]


def rng(a: int, b: int) -> dict[str, list[int]]:
    """The token spec of the tokens ``a .. b - 1`` (``tokens`` items, docs/trace-format.md)."""
    return {"range": [a, b]}


def of(rid: str, n: int) -> dict[str, object]:
    """The token spec of the first ``n`` tokens of request ``rid``."""
    return {"prompt_of": rid, "n": n}


def config(groups: Iterable[Group], h: int, num_blocks: int, **settings: Any) -> dict[str, Any]:
    """A trace config: groups as ``(kind, block_size[, eagle])``, then any other config keys
    (``trace-format.md``) in the order given."""
    docs = [{"kind": g[0], "block_size": g[1], **({"eagle": True} if g[2:] and g[2] else {})}
            for g in groups]
    return {"groups": docs, "hash_block_size": h, "num_blocks": num_blocks, **settings}


class Case:
    """One case being written; with ``record`` adapters every op runs on them in lockstep as
    it is written and the first adapter's observation becomes its ``expect``."""

    def __init__(self, name: str, description: str, config_doc: dict[str, Any],
                 record: tuple[str, ...] = ()) -> None:
        self.name = name
        self.description = description
        self.config = config_doc
        self.run = Lockstep(config_doc, record, strict=True, name=name) if record else None
        self.ops: list[Op] = []
        self.expects: list[Observation | None] = []
        self.steps = Steps(self._emit, connector="connector" in config_doc)

    def _emit(self, trace_op: Op) -> Observation | None:
        obs = self.run.apply(trace_op) if self.run else None
        self.ops.append(trace_op)
        self.expects.append(obs)
        return obs

    def op(self, name: str, **fields: Any) -> Case:
        self._emit(op(name, **fields))
        return self

    def replay(self, ops: Iterable[Op]) -> Case:
        """Write ops as a stored case holds them (their ``expect`` dropped): a counterpart of
        a case for another vLLM release runs the same ops (``release_cases.py``)."""
        for o in ops:
            self._emit({k: v for k, v in o.items() if k != "expect"})
        return self

    def add(self, rid: str, tokens: list[Any], max_tokens: int = 16) -> Case:
        return self.op("add_request", rid=rid, tokens=tokens, max_tokens=max_tokens)

    def step(self, run: Iterable[str] = (), admit: Iterable[str] = (),
             n: Mapping[str, int] | None = None, external: Mapping[str, int] | None = None,
             budget: int | None = None, lookup_connector: bool | None = None,
             finished: Iterable[str] = (), preempted: Iterable[str] = ()) -> Case:
        """One engine step (``Steps.step``)."""
        self.steps.step(run, admit, n, external, budget, lookup_connector, None, finished,
                        preempted)
        return self

    def prefill(self, rid: str, chunks: int) -> Case:
        """``chunks`` planned steps of ``rid``, the first one its admission."""
        self.steps.prefill(rid, chunks)
        return self

    def doc(self) -> dict[str, Any]:
        ops = [{**o, "expect": e} if e is not None else dict(o)
               for o, e in zip(self.ops, self.expects, strict=True)]
        return {"format": FORMAT_TAG, "name": self.name, "description": self.description,
                "config": self.config, "ops": ops}


def _meaning(doc: dict[str, Any]) -> dict[str, Any]:
    """What a case says: description, config, normalised ops, expectations."""
    ops = parse_trace(doc, doc["name"]).ops
    return {"description": doc["description"], "config": doc["config"],
            "ops": [{k: v for k, v in o.items() if k != "expect"} for o in ops],
            "expectations": [o.get("expect") for o in ops]}


def settle(case: Case, stored: Path) -> tuple[dict[str, Any], str | None]:
    """The document to store for ``case`` and how it differs from the stored file (None when
    it means the same: then the stored document is kept as it is, and a case authored
    without running keeps the stored file's reviewed expectations)."""
    new = case.doc()
    if not stored.exists():
        return new, "not stored yet"
    old = json.loads(stored.read_text())
    mine, theirs = _meaning(new), _meaning(old)
    if case.run is None:
        del mine["expectations"], theirs["expectations"]
    for what, value in mine.items():
        if value != theirs[what]:
            if isinstance(value, list):
                at = next((i for i, (a, b) in enumerate(zip(value, theirs[what], strict=False))
                           if a != b), min(len(value), len(theirs[what])))
                return new, f"{what} differ from op {at}"
            return new, f"{what} differs"
    return old, None


def main(builders: Iterable[Callable[[], Case]], argv: list[str] | None = None) -> int:
    """Build the cases (all, or those named), then check or write them."""
    ap = argparse.ArgumentParser(description="author corpus cases")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on a difference")
    ap.add_argument("--out", type=Path, default=CASES_DIR, help="where to write the cases")
    args = ap.parse_args(argv)
    differ = 0
    for build in builders:
        case = build()
        if args.names and case.name not in args.names:
            continue
        doc, why = settle(case, CASES_DIR / f"{case.name}.json")
        differ += why is not None
        print(f"{case.name}: {why or 'same as stored'}", file=sys.stderr)
        if not args.check:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{case.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if args.check and differ else 0
