"""Shrink a diverging trace to a small one with the same divergence (delta debugging).

The divergence to keep is the first one ``run_trace`` reports, identified by its signature:
the two sides compared (adapter and baseline or ``expected``), the op kind, and the first
observation field that differs. Candidates remove, in this order: everything after the
diverging op; whole requests (every op naming the request); runs of engine steps (the ops
from one ``new_step`` to the next), coarse to fine; single ops, coarse to fine (ddmin). A
candidate is kept only if it is a valid trace and still shows a divergence with the same
signature. With two or more adapters the expectations are dropped (the adapters are compared
with each other, and expectations recorded for the full trace would no longer hold); with one
adapter they are kept and the divergence is against them.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailproof.conformance.capture.tokens import run_length
from tailproof.conformance.format.step_protocol import observed_problem
from tailproof.conformance.format.trace import Trace, TraceError, parse_trace
from tailproof.conformance.harness.replay import CaseResult, run_trace

Signature = tuple[str, str, str, str]


def first_field(expected: Any, got: Any) -> str:
    """The first observation key (sorted) whose values differ, or the whole value's type."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for k in sorted(set(expected) | set(got)):
            if k not in got or k not in expected or expected[k] != got[k]:
                return k
        return ""
    return "observation"


def signature(result: CaseResult) -> Signature | None:
    if not result.divergences:
        return None
    d = result.divergences[0]
    return (d.adapter, d.against, d.op, first_field(d.expected, d.got))


@dataclass
class ShrinkResult:
    doc: dict[str, Any]
    signature: Signature
    ops_before: int
    ops_after: int
    runs: int


class _Oracle:
    """Runs candidates; remembers how many runs it took."""

    def __init__(self, base: dict[str, Any], adapters: list[str], strict: bool,
                 want: Signature) -> None:
        self.base = base
        self.adapters = adapters
        self.strict = strict
        self.want = want
        self.runs = 0

    def trace(self, ops: list[dict[str, Any]]) -> Trace | None:
        doc = dict(self.base, ops=ops)
        try:
            return parse_trace(doc, "<shrink>", protocol=True)
        except TraceError:
            return None

    def keeps(self, ops: list[dict[str, Any]]) -> bool:
        t = self.trace(ops)
        if t is None:
            return False
        self.runs += 1
        result = run_trace(t, self.adapters, self.strict)
        # a candidate that breaks the step protocol once its allocations' outcomes are known
        # (a dropped commit) is bad input, not a smaller reproduction
        if observed_problem(t.ops, result.observations[self.adapters[0]]) is not None:
            return False
        return signature(result) == self.want


def _plain_ops(trace: Trace, keep_expect: bool) -> list[dict[str, Any]]:
    """The trace's ops with tokens expanded (a removed request can no longer be referenced
    by ``prompt_of``) and only the fields given in the file."""
    out = []
    for raw, norm in zip(trace.raw["ops"], trace.ops, strict=True):
        op = {k: v for k, v in raw.items() if k not in ("expect", "comment")}
        if "tokens" in op:
            op["tokens"] = list(norm["tokens"])
        if keep_expect and "expect" in raw:
            op["expect"] = raw["expect"]
        out.append(op)
    return out


def _ddmin(ops: list[dict[str, Any]], groups: list[list[int]],
           keeps: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """Remove as many of ``groups`` (lists of op indices) as possible, big chunks first."""
    alive = list(range(len(groups)))
    n = 2
    while alive:
        size = max(1, len(alive) // n)
        removed_any = False
        i = 0
        while i < len(alive):
            chunk = set(alive[i:i + size])
            drop = {j for g in chunk for j in groups[g]}
            cand = [op for j, op in enumerate(ops) if j not in drop]
            if keeps(cand):
                ops = cand
                # Re-index the surviving groups against the shorter op list.
                groups = _reindex(groups, drop)
                alive = [g for g in alive if g not in chunk]
                removed_any = True
            else:
                i += size
        if size == 1 and not removed_any:
            break
        n = n if removed_any else min(len(alive), n * 2) or 1
    return ops


def _reindex(groups: list[list[int]], drop: set[int]) -> list[list[int]]:
    order = sorted(drop)
    return [[j - bisect.bisect_left(order, j) for j in g if j not in drop] for g in groups]


def _request_groups(ops: list[dict[str, Any]]) -> list[list[int]]:
    by_rid: dict[str, list[int]] = {}
    for j, op in enumerate(ops):
        rid = op.get("rid")
        if isinstance(rid, str):
            by_rid.setdefault(rid, []).append(j)
    return list(by_rid.values())


def _step_groups(ops: list[dict[str, Any]]) -> list[list[int]]:
    groups: list[list[int]] = []
    for j, op in enumerate(ops):
        if op["op"] == "new_step" or not groups:
            groups.append([])
        groups[-1].append(j)
    return groups


def reduce_ops(ops: list[dict[str, Any]], cut: int,
               keeps: Callable[[list[dict[str, Any]]], bool],
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The passes of the shrink over any predicate ``keeps`` (True: the candidate still shows
    what is kept): everything from op ``cut`` on, then whole requests, engine steps and single
    ops, coarse to fine. ``tailproof diff`` keeps a difference between two releases with it."""
    say = log or (lambda _m: None)
    if keeps(ops[:cut]):
        ops = ops[:cut]
    say(f"cut after the diverging op: {len(ops)} ops")
    ops = _ddmin(ops, _request_groups(ops), keeps)
    say(f"requests: {len(ops)} ops")
    ops = _ddmin(ops, _step_groups(ops), keeps)
    say(f"steps: {len(ops)} ops")
    ops = _ddmin(ops, [[j] for j in range(len(ops))], keeps)
    say(f"ops: {len(ops)} ops")
    return ops


def plain_ops(trace: Trace) -> list[dict[str, Any]]:
    """A trace's ops as a shrink starts from them: tokens expanded, expectations dropped."""
    return _plain_ops(trace, keep_expect=False)


def shrink(trace: Trace, adapters: list[str], strict: bool = False,
           log: Callable[[str], None] | None = None) -> ShrinkResult:
    """Smallest trace found that diverges like ``trace`` does on ``adapters``."""
    keep_expect = len(adapters) < 2
    base = {k: v for k, v in trace.raw.items() if k != "ops"}
    ops = _plain_ops(trace, keep_expect)
    first_trace = parse_trace(dict(base, ops=ops), trace.source, protocol=True)
    first = run_trace(first_trace, adapters, strict)
    problem = observed_problem(first_trace.ops, first.observations[adapters[0]])
    if problem is not None:
        raise TraceError(f"{trace.source}: {problem} (as run on {adapters[0]})")
    want = signature(first)
    if want is None:
        raise TraceError(f"{trace.source}: no divergence on {','.join(adapters)} to shrink"
                         + ("" if keep_expect else " (adapters compared with each other)"))
    oracle = _Oracle(base, adapters, strict, want)
    before = len(ops)
    ops = reduce_ops(ops, first.divergences[0].op_index + 1, oracle.keeps, log)
    doc = copy.deepcopy(base)
    doc["ops"] = [dict(op, tokens=run_length(op["tokens"])) if "tokens" in op else op
                  for op in ops]
    doc["name"] = f"{trace.name}_shrunk"
    adapter, against, op, field = want
    doc["description"] = (f"Shrunk by `tailproof shrink` from {trace.source} ({before} ops): "
                          f"{adapter} vs {against} diverge on {op}.{field}. "
                          + trace.description)
    return ShrinkResult(doc, want, before, len(ops), oracle.runs)
