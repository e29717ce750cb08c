"""Lemmas of a rank's saved offset (the normal save's resume point; docs/releases.md), proven
with z3 for every outcome of ``K`` saves of one request over ``N`` chunks (lcm units): any job
lengths, any source blocks unavailable, any keys present already, any put codes.

* ``the saved offset covers only stored chunks``: under vLLM 0.34's rule
  (``KVCacheStoreSendingThread._handle_request`` / ``_record_saved_offset``: ``max(offset,
  length)``, only after a save with no failed key and no missing source block) every chunk below
  the offset was stored, so a save resumed there leaves no hole behind (a lookup stops at the
  first missing key, and no later save would fill one).
* ``the saved offset never moves back``.

vLLM 0.33's rule (``_record_saved``: the job's length after any save that did not fail,
unavailable sources skipped) is the seeded mutant: it skips a chunk whose source was missing
for good. The rule is a parameter, as the lemmas' other functions are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from .solve import LemmaResult, prove_claim

N = 6  # chunks of one request
K = 3  # saves in a row
Bools = Sequence[z3.BoolRef]
#: (offset, stored, length, source available, put ok) -> (offset, stored)
SaveFn = Callable[[z3.ArithRef, Bools, z3.ArithRef, Bools, Bools],
                  tuple[z3.ArithRef, list[z3.BoolRef]]]


def _save(o: z3.ArithRef, stored: Bools, n: z3.ArithRef, avail: Bools, ok: Bools,
          monotone: bool) -> tuple[z3.ArithRef, list[z3.BoolRef]]:
    """One normal save of chunks ``[o, n)``: the keys present are deduplicated, the missing
    ones with a source are put (each lands where its code is ok), then the offset moves."""
    in_range = [z3.And(o <= i, i < n) for i in range(N)]
    put = [z3.And(r, a, z3.Not(s)) for r, a, s in zip(in_range, avail, stored, strict=True)]
    failed = z3.Or(*[z3.And(p, z3.Not(k)) for p, k in zip(put, ok, strict=True)])
    missing = z3.Or(*[z3.And(r, z3.Not(a)) for r, a in zip(in_range, avail, strict=True)])
    after = [z3.Or(s, z3.And(p, k)) for s, p, k in zip(stored, put, ok, strict=True)]
    if monotone:  # 0.34: a job at or below the offset returns at once
        complete = z3.And(n > o, z3.Not(failed), z3.Not(missing))
        return z3.If(complete, z3.If(n > o, n, o), o), after
    complete = z3.And(n > 0, z3.Not(failed))  # 0.33: ``token_len == 0`` returns at once
    return z3.If(complete, n, o), after


def save_034(o: z3.ArithRef, stored: Bools, n: z3.ArithRef, avail: Bools,
             ok: Bools) -> tuple[z3.ArithRef, list[z3.BoolRef]]:
    """vLLM 0.34's rule (``Release.monotone_saved_offset``)."""
    return _save(o, stored, n, avail, ok, monotone=True)


def save_033(o: z3.ArithRef, stored: Bools, n: z3.ArithRef, avail: Bools,
             ok: Bools) -> tuple[z3.ArithRef, list[z3.BoolRef]]:
    """vLLM 0.33's rule, the seeded mutant: any save that did not fail sets the offset."""
    return _save(o, stored, n, avail, ok, monotone=False)


def _run(save: SaveFn) -> tuple[list[z3.ArithRef], list[list[z3.BoolRef]], list[z3.BoolRef]]:
    """Offsets and store contents after each of ``K`` saves from offset 0 and any store."""
    o: z3.ArithRef = z3.IntVal(0)
    stored: list[z3.BoolRef] = [z3.Bool(f"s0_{i}") for i in range(N)]
    offsets, stores, hyps = [o], [stored], []
    for k in range(K):
        n = z3.Int(f"n{k}")
        hyps += [n >= 0, n <= N]
        avail = [z3.Bool(f"a{k}_{i}") for i in range(N)]
        ok = [z3.Bool(f"ok{k}_{i}") for i in range(N)]
        o, stored = save(o, stored, n, avail, ok)
        offsets.append(o)
        stores.append(stored)
    return offsets, stores, hyps


def offset_covers_stored(save: SaveFn = save_034) -> LemmaResult:
    offsets, stores, hyps = _run(save)
    claim = z3.And(*[z3.Implies(i < o, s[i]) for o, s in zip(offsets, stores, strict=True)
                     for i in range(N)])
    return prove_claim("the saved offset covers only stored chunks", hyps, claim)


def offset_monotone(save: SaveFn = save_034) -> LemmaResult:
    offsets, _, hyps = _run(save)
    claim = z3.And(*[a <= b for a, b in zip(offsets, offsets[1:], strict=False)])
    return prove_claim("the saved offset never moves back", hyps, claim)


def offset_lemmas() -> list[LemmaResult]:
    """The saved-offset lemmas, in table order."""
    return [offset_covers_stored(), offset_monotone()]


def offset_mutants() -> dict[str, list[LemmaResult]]:
    """vLLM 0.33's offset rule, which the lemmas refute."""
    return {"offset_past_missing_source": [offset_covers_stored(save_033)]}
