"""The differential runner: run each trace on every named adapter, compare op by op with each
other and with the trace's expected observations, and report the first divergence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tailproof.conformance.format.compare import Renamer, project, subset_match
from tailproof.conformance.format.step_protocol import observed_problem
from tailproof.conformance.format.trace import Trace, TraceError
from tailproof.conformance.harness.adapters import make_driver, refusal
from tailproof.conformance.harness.releases import ReleaseGate

EXPECTED = "expected"


@dataclass
class Divergence:
    case: str
    op_index: int
    op: str
    adapter: str
    against: str  # "expected" or the baseline adapter's name
    expected: Any
    got: Any

    def as_json(self) -> dict[str, Any]:
        return {"case": self.case, "op_index": self.op_index, "op": self.op,
                "adapter": self.adapter, "against": self.against,
                "expected": self.expected, "got": self.got}


@dataclass
class CaseResult:
    trace: Trace
    adapters: list[str]
    observations: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.trace.name

    unsupported: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # adapter -> why it ran nothing

    def skipped(self) -> dict[str, dict[str, Any]]:
        """Per adapter: the op names it does not support and the number of ops it ran without
        observing them (after the first unsupported op its block state is no longer
        comparable: a connector's pins change free counts and refcounts); an adapter that
        refused the whole trace (``adapters.refusal``) says why under ``refused``."""
        out: dict[str, dict[str, Any]] = {}
        for a, obs in self.observations.items():
            unobserved = sum(o is None for o in obs)
            if unobserved:
                out[a] = {"unsupported_ops": self.unsupported.get(a, []),
                          "unobserved_ops": unobserved}
                if a in self.refused:
                    out[a]["refused"] = self.refused[a]
        return out


def _canon_stream(stream: list[dict[str, Any] | None], strict: bool) -> list[Any]:
    if strict:
        return list(stream)
    r = Renamer()
    return [None if o is None else r.canon(o) for o in stream]


def run_trace(trace: Trace, adapters: list[str], strict: bool = False,
              options: dict[str, dict[str, Any]] | None = None) -> CaseResult:
    """Run ``trace`` on each adapter (fresh state each) and collect divergences: each adapter
    against the expectations, then each adapter against the first one, first op only. An
    adapter refuses a trace it cannot run faithfully (``adapters.refusal``, and for the
    vLLM-backed ones a trace of another release they disagree on, ``releases.ReleaseGate``).
    ``options`` maps an adapter name to its ``make_driver`` options."""
    t0 = time.perf_counter()
    result = CaseResult(trace, list(adapters))
    gate = ReleaseGate(trace)
    for name in adapters:
        why = refusal(name, trace.config) or gate.refusal(name)
        if why is not None:  # observed nothing: compared with nothing
            result.observations[name] = [None] * len(trace.ops)
            result.unsupported[name] = []
            result.refused[name] = why
            continue
        driver = make_driver(name, trace.config, (options or {}).get(name))
        try:
            result.observations[name] = [driver.apply(op) for op in trace.ops]
        finally:
            driver.close()
        result.unsupported[name] = sorted({op["op"] for op in trace.ops
                                           if not driver.supports(op["op"])})
    expects = [op.get("expect") for op in trace.ops]
    expected = _canon_stream(expects, strict)
    canon = {a: _canon_stream(s, strict) for a, s in result.observations.items()}
    for a in adapters:
        # Against the expectations, ids are renamed over the expected fields only.
        seen = canon[a] if strict else _canon_stream(
            [None if e is None or o is None else project(e, o)
             for e, o in zip(expects, result.observations[a], strict=True)], strict)
        for i, (exp, got) in enumerate(zip(expected, seen, strict=True)):
            if exp is not None and got is not None and not subset_match(exp, got):
                result.divergences.append(Divergence(
                    trace.name, i, trace.ops[i]["op"], a, EXPECTED, exp, got))
                break
    base = adapters[0]
    for a in adapters[1:]:
        for i, (b_obs, a_obs) in enumerate(zip(canon[base], canon[a], strict=True)):
            if b_obs is not None and a_obs is not None and b_obs != a_obs:
                result.divergences.append(Divergence(
                    trace.name, i, trace.ops[i]["op"], a, base, b_obs, a_obs))
                break
    result.seconds = time.perf_counter() - t0
    return result


def _short(op: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in op.items()
                     if k not in ("op", "expect", "comment", "tokens"))
    if "tokens" in op:
        args = (args + ", " if args else "") + f"tokens=<{len(op['tokens'])}>"
    return f"{op['op']}({args})"


def format_divergence(result: CaseResult, d: Divergence, context: int = 3) -> str:
    """The diverging op side by side with the few ops before it."""
    lines = [f"DIVERGENCE in {d.case} ({result.trace.source}) at op {d.op_index} ({d.op}): "
             f"{d.adapter} vs {d.against}"]
    left = d.against
    for i in range(max(0, d.op_index - context), d.op_index + 1):
        mark = ">>" if i == d.op_index else "  "
        lines.append(f"{mark} [{i}] {_short(result.trace.ops[i])}")
        if left == EXPECTED:
            lv = result.trace.ops[i].get("expect")
        else:
            lv = result.observations[left][i]
        rv = result.observations[d.adapter][i]
        if i == d.op_index:
            lv, rv = d.expected, d.got
        lines.append(f"     {left:>14}: {lv}")
        lines.append(f"     {d.adapter:>14}: {rv}")
    return "\n".join(lines)


def check_replayed(result: CaseResult) -> None:
    """``replay``: refuse (TraceError, exit 2) a trace whose run broke the step protocol once
    its allocations' outcomes were known, instead of reporting the divergence it causes."""
    for a in result.adapters:
        if a in result.refused:
            continue
        problem = observed_problem(result.trace.ops, result.observations[a])
        if problem is not None:
            raise TraceError(f"{result.trace.source}: {problem} (as run on {a})")
        return
