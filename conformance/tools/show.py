"""``tailproof replay --show``: every op with each adapter's observation side by side, and the
check that an ``expect`` only names fields some adapter observes.
"""

from __future__ import annotations

import json
from typing import Any

from tailproof.conformance.format.trace import TraceError
from tailproof.conformance.harness.errors import UsageError
from tailproof.conformance.harness.replay import EXPECTED, CaseResult


def parse_range(text: str | None, n: int) -> range:
    """``A:B`` (either side may be empty; B exclusive) as a range of op indices."""
    if not text:
        return range(n)
    a, sep, b = text.partition(":")
    try:
        start = int(a) if a else 0
        stop = int(b) if b else n
        if not sep:
            stop = start + 1
    except ValueError:
        raise UsageError(f"--ops: expected A:B (op indices), got {text!r}",
                         "e.g. --ops 120:140") from None
    if start < 0 or stop < start:
        raise UsageError(f"--ops: expected 0 <= A <= B, got {text!r}", "e.g. --ops 120:140")
    return range(start, min(stop, n))


def op_label(op: dict[str, Any]) -> str:
    args = []
    for k, v in op.items():
        if k in ("op", "expect", "comment") or v is None or v is False:
            continue
        if k == "tokens":
            args.append(f"tokens=<{len(v)}>")
        else:
            args.append(f"{k}={json.dumps(v, separators=(',', ':'))}")
    return f"{op['op']}({', '.join(args)})"


def _fmt(obs: Any) -> str:
    if obs is None:
        return "(not run)"
    if isinstance(obs, dict):
        return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in obs.items())
    return json.dumps(obs)


def format_show(result: CaseResult, ops: range) -> str:
    """Each op of ``ops``, then one line per side: the expectation and every adapter; an
    adapter that agrees with the line above it prints ``=``, a disagreement is marked ``!!``."""
    trace = result.trace
    names = [EXPECTED] + result.adapters
    width = max(len(n) for n in names)
    diverged = {d.op_index for d in result.divergences}
    lines = [f"== {trace.name} ({trace.source}): ops {ops.start}..{ops.stop - 1} "
             f"of {len(trace.ops)}"]
    for i in ops:
        op = trace.ops[i]
        mark = "!!" if i in diverged else "  "
        lines.append(f"{mark}[{i}] {op_label(op)}")
        prev: Any = None
        exp = op.get("expect")
        if exp is not None:
            lines.append(f"     {EXPECTED:>{width}}: {_fmt(exp)}")
        for n, a in enumerate(result.adapters):
            obs = result.observations[a][i]
            if n and obs is not None and obs == prev:
                text = "="
            else:
                text = _fmt(obs)
            flag = "!!" if exp is not None and obs is not None and any(
                k in obs and obs[k] != v for k, v in exp.items()) else "  "
            lines.append(f"   {flag}{a:>{width}}: {text}")
            prev = obs
    return "\n".join(lines)


def check_expect_keys(result: CaseResult) -> None:
    """Raise ``TraceError`` for an ``expect`` key that no adapter observes on that op (a typo
    or a field of another op is bad input, not a divergence). Ops that every adapter skipped
    or that raised everywhere are not judged."""
    for i, op in enumerate(result.trace.ops):
        exp = op.get("expect")
        if not exp:
            continue
        seen = [o for o in (result.observations[a][i] for a in result.adapters)
                if o is not None and "error" not in o]
        if not seen:
            continue
        known = set().union(*seen) | {"error"}
        for key in exp:
            if key not in known:
                raise TraceError(f"{result.trace.source}: ops[{i}].expect.{key}: no adapter "
                                 f"observes {key!r} on op {op['op']!r} (observed: "
                                 f"{', '.join(sorted(known))})")
