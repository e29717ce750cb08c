"""Replay traces on two vLLM releases and report every behaviour change (``tailproof diff``).

Each trace's ops run on the vLLM-backed adapters of both sides (``sides.Worker``: one process
per release). Where the two observe an op differently, the first such op is the trace's
change: it is shrunk (``shrink.reduce_ops`` with a predicate that replays each candidate on
both sides and keeps the same difference: the same adapter, op kind and first differing
field) and explained (``explain.py``) on the small trace; when the small trace leaves the
reference's model, the change is explained on the whole trace instead. A trace that one side
runs and the other refuses is listed as not compared, with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tailproof.conformance.capture.tokens import run_length
from tailproof.conformance.format.step_protocol import observed_problem
from tailproof.conformance.format.trace import Trace, TraceError, parse_trace
from tailproof.conformance.tools.diff.explain import KINDS, UNEXPLAINED, Explanation, explain
from tailproof.conformance.tools.diff.sides import Worker
from tailproof.conformance.tools.shrink import first_field, plain_ops, reduce_ops

Obs = list[dict[str, Any] | None]


@dataclass
class Change:
    """One trace's first behaviour change between the two releases."""

    trace: str
    source: str
    adapter: str
    op_index: int
    op: str
    field: str
    before: Any  # the first release's observation
    after: Any  # the second release's
    kind: str
    reason: str
    switches: list[str]
    bug: str | None
    shrunk: dict[str, Any]  # the small trace (no expectations)
    shrunk_op_index: int
    ops_before: int
    ops_after: int
    replays: int
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DiffReport:
    sides: tuple[dict[str, Any], dict[str, Any]]
    adapters: list[str]
    traces: int = 0
    compared: int = 0
    changes: list[Change] = field(default_factory=list)
    not_compared: dict[str, str] = field(default_factory=dict)  # trace -> why
    same: list[str] = field(default_factory=list)  # traces observed alike
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return {k: sum(c.kind == k for c in self.changes) for k in KINDS}

    @property
    def explained(self) -> bool:
        return not self.counts[UNEXPLAINED]

    def body(self) -> dict[str, Any]:
        return {"from": self.sides[0], "to": self.sides[1], "adapters": self.adapters,
                "traces": self.traces, "compared": self.compared, "counts": self.counts,
                "changes": [c.as_json() for c in self.changes],
                "not_compared": self.not_compared, "unchanged": len(self.same)}


def _stream(reply: dict[str, Any], adapter: str, n: int) -> Obs | None:
    """The adapter's observations from a worker reply (an op that raised observes the error,
    the ops after it nothing); None when it refused or did not run."""
    if "failed" in reply or adapter not in reply["observations"]:
        return None
    obs: Obs = list(reply["observations"][adapter])
    err = reply["error"].get(adapter)
    if err is not None:
        obs.append({"error": err["error"]})
    return obs + [None] * (n - len(obs))


def first_difference(a: Obs, b: Obs) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                 if x is not None and y is not None and x != y), None)


class Differ:
    """The two workers and what they are asked."""

    def __init__(self, a: Worker, b: Worker, adapters: list[str],
                 log: Callable[[str], None] | None = None) -> None:
        self.a, self.b = a, b
        self.adapters = adapters
        self.say = log or (lambda _m: None)

    def both(self, doc: dict[str, Any], adapters: list[str]
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.a.replay(doc, adapters), self.b.replay(doc, adapters)

    def _shrink(self, trace: Trace, adapter: str, at: int, want: tuple[str, str]
                ) -> tuple[list[dict[str, Any]], int]:
        """The smallest ops found that still differ like ``want`` (op kind, field)."""
        base = {k: v for k, v in trace.raw.items() if k not in ("ops", "description")}
        replays = 0

        def keeps(ops: list[dict[str, Any]]) -> bool:
            nonlocal replays
            try:
                cand = parse_trace(dict(base, ops=ops), "<diff>", protocol=True)
            except TraceError:
                return False
            replays += 1
            ra, rb = self.both(dict(base, ops=ops), [adapter])
            sa, sb = _stream(ra, adapter, len(ops)), _stream(rb, adapter, len(ops))
            if sa is None or sb is None or observed_problem(cand.ops, sa) is not None \
                    or observed_problem(cand.ops, sb) is not None:
                return False
            i = first_difference(sa, sb)
            return i is not None and (ops[i]["op"], first_field(sa[i], sb[i])) == want

        ops = reduce_ops(plain_ops(trace), at + 1, keeps)
        return ops, replays

    def compare(self, trace: Trace, report: DiffReport) -> None:
        t0 = time.perf_counter()
        doc = {k: v for k, v in trace.raw.items() if k != "ops"}
        doc["ops"] = plain_ops(trace)
        ra, rb = self.both(doc, self.adapters)
        report.traces += 1
        for side, reply in ((report.sides[0], ra), (report.sides[1], rb)):
            if "failed" in reply:
                report.not_compared[trace.name] = f"{side['side']}: {reply['failed']}"
                return
        n = len(trace.ops)
        found: tuple[int, str, Obs, Obs] | None = None
        ran = False
        for adapter in self.adapters:
            sa, sb = _stream(ra, adapter, n), _stream(rb, adapter, n)
            if sa is None and sb is None:
                continue
            if sa is None or sb is None:
                who, reply = (report.sides[0], ra) if sa is None else (report.sides[1], rb)
                report.not_compared[trace.name] = (f"{adapter} refuses it on {who['side']}: "
                                                   f"{reply['refused'].get(adapter)}")
                return
            ran = True
            i = first_difference(sa, sb)
            if i is not None and (found is None or i < found[0]):
                found = (i, adapter, sa, sb)
        if not ran:
            why = next(iter({**ra["refused"], **rb["refused"]}.values()), "no adapter runs it")
            report.not_compared[trace.name] = why
            return
        report.compared += 1
        if found is None:
            report.same.append(trace.name)
            return
        at, adapter, sa, sb = found
        want = (trace.ops[at]["op"], first_field(sa[at], sb[at]))
        self.say(f"{trace.name}: {adapter} differs at op {at} ({want[0]}.{want[1]}); "
                 "shrinking")
        ops, replays = self._shrink(trace, adapter, at, want)
        small = parse_trace(dict(trace.raw, ops=ops, name=f"{trace.name}_diff"), "<diff>",
                            protocol=True)
        s_ra, s_rb = self.both(dict(small.raw), [adapter])
        s_a, s_b = _stream(s_ra, adapter, len(ops)), _stream(s_rb, adapter, len(ops))
        assert s_a is not None and s_b is not None
        s_at = first_difference(s_a, s_b)
        assert s_at is not None
        rel_a, rel_b = report.sides[0]["release"], report.sides[1]["release"]
        why: Explanation = explain(small, s_at, s_a, s_b, rel_a, rel_b)
        if why.kind == UNEXPLAINED:  # the small trace may have left the model: the whole one
            whole = explain(trace, at, sa, sb, rel_a, rel_b)
            why = whole if whole.kind != UNEXPLAINED else why
        out = {k: v for k, v in trace.raw.items() if k not in ("ops", "description")}
        out.update(name=f"{trace.name}_diff", description=(
            f"Shrunk by `tailproof diff` from {trace.source} ({n} ops): vLLM "
            f"{report.sides[0]['side']} and {report.sides[1]['side']} observe op {s_at} "
            f"({want[0]}.{want[1]}) differently on {adapter}: {why.kind}"
            + (f" ({why.bug})" if why.bug else "")
            + (f" ({', '.join(why.switches)})" if why.switches else "") + "."),
            ops=[dict(o, tokens=run_length(o["tokens"])) if "tokens" in o else o
                 for o in ops])
        report.changes.append(Change(
            trace.name, trace.source, adapter, at, want[0], want[1], sa[at], sb[at], why.kind,
            why.reason, why.switches, why.bug, out, s_at, n, len(ops), replays,
            round(time.perf_counter() - t0, 3)))


def format_report(report: DiffReport) -> str:
    a, b = report.sides[0]["side"], report.sides[1]["side"]
    lines = []
    for c in report.changes:
        what = c.bug or ", ".join(c.switches) or "-"
        lines.append(f"{c.kind.upper():<12} {c.trace}[{c.op_index}] {c.op}.{c.field} on "
                     f"{c.adapter}: {what}")
        lines.append(f"{'':<12} shrunk {c.ops_before} -> {c.ops_after} ops (differs at op "
                     f"{c.shrunk_op_index}); {c.reason}")
    for name, why in sorted(report.not_compared.items()):
        lines.append(f"{'NOT COMPARED':<12} {name}: {why}")
    counts = report.counts
    lines.append(
        f"diff vLLM {a} ({report.sides[0]['vllm']}) -> {b} ({report.sides[1]['vllm']}) on "
        f"{','.join(report.adapters)}: {report.traces} traces, {report.compared} compared, "
        f"{len(report.changes)} changed ({counts['rule_change']} documented rule changes, "
        f"{counts['fixed_bug']} fixed upstream bugs, {counts['unexplained']} unexplained), "
        f"{len(report.not_compared)} not compared; {report.seconds:.1f}s")
    return "\n".join(lines)
