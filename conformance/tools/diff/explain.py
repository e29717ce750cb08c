"""Why two vLLM releases observe one op differently: a fixed upstream bug, a documented rule
change, or nothing tailproof knows of.

- **fixed upstream bug** (``docs/history.md``): a bug whose status differs between the two
  releases (present in one, fixed in the other) and whose trace detector
  (``history/findings.py``) fires at that op on the side that has the bug, not on the other.
- **documented rule change** (``docs/releases.md``, "What changed in 0.34"): the reference,
  which follows the release a trace names through one switch per difference
  (``reference/releases.py``), reproduces both releases' observations at that op, and the
  switches that account for the difference are named: each single switch that, flipped from
  the first release's value to the second's, turns the first release's observation into the
  second's; else every switch whose revert alone changes the second release's.
- **unexplained**: neither. The reference's model does not say the releases differ here.

Everything here runs the reference in this process; only the observations of vLLM itself
come from the two worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tailproof.conformance.format.trace import Trace
from tailproof.conformance.harness.adapters import make_driver
from tailproof.conformance.tools.history import findings as hf
from tailproof.conformance.tools.history.bugs import BUGS, FIXED, PRESENT
from tailproof.reference.releases import RELEASES

FIXED_BUG, RULE_CHANGE, UNEXPLAINED = "fixed_bug", "rule_change", "unexplained"
KINDS = (RULE_CHANGE, FIXED_BUG, UNEXPLAINED)
SWITCHES = tuple(f.name for f in fields(next(iter(RELEASES.values()))) if f.name != "name")

Obs = list[dict[str, Any] | None]


@dataclass
class Explanation:
    kind: str
    reason: str
    switches: list[str] = field(default_factory=list)
    bug: str | None = None


@contextmanager
def _hypothetical(base: str, **switches: bool) -> Iterator[str]:
    """A release that is ``base`` with ``switches`` set, registered for the reference to
    follow while the block runs (a trace names its release by key)."""
    name = f"{base}+" + "+".join(f"{k}={v}" for k, v in switches.items())
    RELEASES[name] = replace(RELEASES[base], name=name, **switches)
    try:
        yield name
    finally:
        del RELEASES[name]


def reference_stream(trace: Trace, release: str) -> Obs:
    """What the reference observes on ``trace``'s ops following ``release``."""
    driver = make_driver("reference", replace(trace.config, vllm=release))
    try:
        return [driver.apply(op) for op in trace.ops]
    finally:
        driver.close()


def _at(trace: Trace, release: str, at: int, **switches: bool) -> Any:
    if not switches:
        return reference_stream(trace, release)[at]
    with _hypothetical(release, **switches) as name:
        return reference_stream(trace, name)[at]


def fixed_bug(trace: Trace, at: int, a: Obs, b: Obs, ra: str, rb: str) -> str | None:
    """The bug whose fix between ``ra`` and ``rb`` (either way) shows at op ``at``."""
    ops, config = trace.raw["ops"], trace.raw["config"]
    for bug in BUGS:
        sa, sb = bug.at(ra), bug.at(rb)
        if {sa.status, sb.status} != {PRESENT, FIXED}:
            continue
        present = sa if sa.status == PRESENT else sb
        if present.finding not in hf.TRACE_DETECTORS:
            continue
        detect = hf.TRACE_DETECTORS[present.finding][2]
        buggy, fixed = (a, b) if present is sa else (b, a)
        if (any(i == at for i, _ in detect(ops, buggy, config))
                and not any(i == at for i, _ in detect(ops, fixed, config))):
            return bug.ref
    return None


def rule_change(trace: Trace, at: int, b_at: Any, ra: str, rb: str
                ) -> tuple[list[str], str] | None:
    """The switches that account for release ``rb`` observing ``b_at`` at op ``at`` where
    ``ra`` observes otherwise (the reference already reproduces both there); None when no
    switch differs."""
    rel_a, rel_b = RELEASES[ra], RELEASES[rb]
    differing = [s for s in SWITCHES if getattr(rel_a, s) != getattr(rel_b, s)]
    if not differing:
        return None
    singles = [s for s in differing if _at(trace, ra, at, **{s: getattr(rel_b, s)}) == b_at]
    if singles:
        return singles, (f"with only {' or '.join(singles)} set as in {rb}, the reference "
                         f"under {ra} observes what vLLM {rb} does")
    needed = [s for s in differing if _at(trace, rb, at, **{s: getattr(rel_a, s)}) != b_at]
    named = needed or differing
    return named, (f"the reference under {ra} and under {rb} observes what each vLLM does; "
                   f"reverting any of {', '.join(named)} alone changes {rb}'s observation")


def explain(trace: Trace, at: int, a: Obs, b: Obs, ra: str, rb: str) -> Explanation:
    """Why ``a`` (release ``ra``'s observations) and ``b`` differ at op ``at`` of ``trace``."""
    bug = fixed_bug(trace, at, a, b, ra, rb)
    ref_a, ref_b = reference_stream(trace, ra)[at], reference_stream(trace, rb)[at]
    modelled = ref_a == a[at] and ref_b == b[at]
    rule = rule_change(trace, at, b[at], ra, rb) if modelled else None
    switches, why = rule if rule is not None else ([], "")
    if bug is not None:
        fixed_in = rb if next(x for x in BUGS if x.ref == bug).at(rb).status == FIXED else ra
        return Explanation(FIXED_BUG, f"{bug} is fixed in {fixed_in} (docs/history.md): its "
                           "detector fires here on the release that has it only", switches,
                           bug)
    if rule is not None:
        return Explanation(RULE_CHANGE, why + " (docs/releases.md, \"What changed in 0.34\")",
                           switches)
    for rel, ref, got in ((ra, ref_a, a[at]), (rb, ref_b, b[at])):
        if ref != got:
            return Explanation(UNEXPLAINED, f"the reference under {rel} observes {ref}, "
                               f"vLLM {rel} {got}: the model does not follow it here")
    return Explanation(UNEXPLAINED, f"no switch differs between {ra} and {rb}: the model "
                       "says the two releases agree here")
