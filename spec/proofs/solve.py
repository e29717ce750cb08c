"""One z3 query for a lemma: the claim's negation under its hypotheses (``unsat`` = proved,
``sat`` = a counterexample with its model, ``unknown`` = neither, e.g. a timeout). Shared by
every lemma module (``lemmas``, ``remembered``, ``induction``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import z3

TIMEOUT_MS = 20_000


@dataclass
class LemmaResult:
    """Outcome of one lemma: ``proved``, ``counterexample`` (with the model) or ``unknown``."""

    name: str
    result: str
    seconds: float
    model: str | None = None


def prove_claim(name: str, hyps: list, claim: z3.BoolRef) -> LemmaResult:
    """Ask z3 for a model of ``hyps`` and not ``claim``: none is a proof."""
    t0 = time.monotonic()
    s = z3.Solver()
    s.set("timeout", TIMEOUT_MS)
    s.add(*hyps)
    s.add(z3.Not(claim))
    r = s.check()
    dt = time.monotonic() - t0
    if r == z3.unsat:
        return LemmaResult(name, "proved", dt)
    if r == z3.sat:
        return LemmaResult(name, "counterexample", dt, str(s.model()))
    return LemmaResult(name, "unknown", dt)
