"""Seeded mutants of the transition rules: each must be killed (yield a counterexample).

A mutant is a named deviation switched on by ``Config.mutant`` inside :mod:`spec.model`. The
bounded search runs on the mutated model; the first invariant violation is the counterexample,
reported with its shortest action sequence. ``ck_off_by_one`` and ``hit_unaligned`` are
additionally killed by the z3 lemmas run on the mutated arithmetic (see ``lemmas.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..model import Config
from .bmc import bmc

#: name -> (what the seeded bug does, config overrides for the instance that exposes it)
MUTANTS: dict[str, tuple[str, dict]] = {
    "drop_pin": ("the connector records a store job but does not touch its blocks", {}),
    "release_early": ("a CoW retention is released when the copy is queued, before it ran", {}),
    "early_unpin": ("a store job unpins at the first rank's report, not the last", {}),
    "pin_null": ("the job's blocks are resolved positionally from the Mamba table, nulls kept",
                 {"h": 1, "bs_fa": 1, "bs_mamba": 2, "prompts": ((1, 1, 2, 2), (1, 1, 2, 2, 3))}),
    "handoff_after_free": ("preemption keeps the request's undrained hand-offs",
                           {"priority_preempt": True}),
    "ck_off_by_one": ("ck(P) uses floor(P/h)*h (forgets the recomputed last token)", {}),
    "hit_unaligned": ("the joint hit is capped by num_tokens-1 instead of its A-floor", {}),
    "no_clipping": ("FA keeps its longer hit when Mamba lacks the tail (no cdiv truncation)", {}),
    "put_fail_key": ("a failed (-200) put still leaves its key in the store", {}),
    "double_free": ("preemption frees the tables but does not pop them", {}),
    "no_same_step_defer": ("a Mamba key registered/moved this step is hit in the same step", {}),
    "no_key_move": ("the running CoW leaves the tail key on the overwritten source", {}),
}


@dataclass
class MutantResult:
    """Whether a mutant was killed, by which invariant, and the counterexample."""

    name: str
    killed: bool
    invariant: str | None
    message: str | None
    trace: list[tuple] | None
    seconds: float
    config: Config


def run_mutant(name: str, base: Config, depth: int, deadline_s: float = 30.0) -> MutantResult:
    """Search the mutated model up to ``depth`` for an invariant violation."""
    t0 = time.monotonic()
    cfg = replace(base, mutant=name, **MUTANTS[name][1])
    r = bmc(cfg, depth, deadline_s=deadline_s)
    v = r.violation
    return MutantResult(name, not r.ok, v[0] if v else None, v[1] if v else None, r.trace,
                        time.monotonic() - t0, cfg)
