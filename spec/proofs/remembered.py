"""Lemmas of remembered lookups (``impl.lookup.StoreLookup``, ``reference.connector.lookup.
remembered_lookup``; docs/connector-ops.md, "Remembered lookups"), proven with z3 for every
store content over ``N`` prefix keys of one full-attention group (the prefix-shaped part of a
hit; other groups are checked against a fresh lookup by tests/impl/test_remembered_lookup.py).

* ``remembered hit == fresh hit``: between two asks with no removal reported by a store that
  reports them, keys are only added; then re-asking from the last answer's frontier (contiguous
  probes) gives exactly the fresh lookup's hit.
* ``unchanged store: the remembered answer stands``: a store that counts every key it adds or
  drops and reports no change between two asks holds the same keys, so answering from the
  memo without asking (``Store.change_count``) gives exactly the fresh lookup's hit.
* ``a remembered hit never serves bytes the store no longer holds``: whatever happened to the
  store between the ask and the load (an unreported eviction, one in the middle of the prefix),
  the load of the remembered hit either finds every key of it and writes each block from its
  key, or writes nothing and fails (the request is recomputed).

The re-ask and the load are parameters, so seeded mutants of them are refuted the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import z3

from .solve import LemmaResult, prove_claim

N = 8
Bools = Sequence[z3.BoolRef]
ReaskFn = Callable[[Bools, Bools, z3.BoolRef], z3.ArithRef]
LoadFn = Callable[[z3.ArithRef, Bools], tuple[z3.BoolRef, list[z3.BoolRef]]]


def prefix(s: Bools, start: int = 0) -> z3.ArithRef:
    """Leading present keys of ``s`` from ``start`` (a full-attention hit, in keys)."""
    out: z3.ArithRef = z3.IntVal(len(s) - start)
    for i in range(len(s) - 1, start - 1, -1):
        out = z3.If(s[i], out, z3.IntVal(i - start))
    return out


def reask(s0: Bools, s1: Bools, reported: z3.BoolRef) -> z3.ArithRef:
    """The connector's second ask: after a reported removal, everything again; else from the
    first ask's frontier ``r0`` on, contiguously (keys below it are remembered present)."""
    r0 = prefix(s0)
    cont: z3.ArithRef = z3.IntVal(len(s1))
    for k in range(len(s1), -1, -1):
        cont = z3.If(r0 == k, k + prefix(s1, k), cont)
    return z3.If(reported, prefix(s1), cont)


def load(r: z3.ArithRef, s2: Bools) -> tuple[z3.BoolRef, list[z3.BoolRef]]:
    """``WorkerSide._load``: all or nothing -- every key below ``r`` read, else none written."""
    ok = z3.And(*[z3.Implies(i < r, s2[i]) for i in range(len(s2))])
    return ok, [z3.And(ok, i < r) for i in range(len(s2))]


def _stores(tag: str) -> list[z3.BoolRef]:
    return [z3.Bool(f"{tag}{i}") for i in range(N)]


def remembered_equals_fresh(ask: ReaskFn = reask) -> LemmaResult:
    s0, s1 = _stores("s0_"), _stores("s1_")
    reported, can_report = z3.Bools("reported can_report")
    # a store that reports removals and reported none between the asks only added keys
    added_only = z3.Implies(z3.And(can_report, z3.Not(reported)),
                            z3.And(*[z3.Implies(a, b) for a, b in zip(s0, s1, strict=True)]))
    return prove_claim("remembered hit == fresh hit (no removal reported)",
                  [added_only, can_report], ask(s0, s1, reported) == prefix(s1))


AskFn = Callable[[Bools, Bools, z3.BoolRef, z3.BoolRef], z3.ArithRef]


def ask_counted(s0: Bools, s1: Bools, reported: z3.BoolRef,
                unchanged: z3.BoolRef) -> z3.ArithRef:
    """The connector's second ask over a store that counts its changes: none reported, the
    first answer is kept and nothing is asked; else :func:`reask`."""
    return z3.If(unchanged, prefix(s0), reask(s0, s1, reported))


def unchanged_answer_stands(ask: AskFn = ask_counted) -> LemmaResult:
    s0, s1 = _stores("s0_"), _stores("s1_")
    reported, unchanged = z3.Bools("reported unchanged")
    same_keys = z3.Implies(unchanged, z3.And(*[a == b for a, b in zip(s0, s1, strict=True)]))
    no_removal = z3.Implies(z3.Not(reported),
                            z3.And(*[z3.Implies(a, b) for a, b in zip(s0, s1, strict=True)]))
    return prove_claim("unchanged store: the remembered answer stands",
                       [same_keys, no_removal, z3.Implies(unchanged, z3.Not(reported))],
                       ask(s0, s1, reported, unchanged) == prefix(s1))


def remembered_never_serves_gone_bytes(ask: ReaskFn = reask,
                                       ld: LoadFn = load) -> LemmaResult:
    s0, s1, s2 = _stores("s0_"), _stores("s1_"), _stores("s2_")
    reported = z3.Bool("reported")
    r = ask(s0, s1, reported)  # any stores, any reports: an unreported eviction included
    ok, written = ld(r, s2)
    every_block = z3.And(*[z3.Implies(i < r, z3.And(s2[i], written[i])) for i in range(N)])
    claim = z3.And(z3.Implies(ok, every_block),
                   z3.Implies(z3.Not(ok), z3.And(*[z3.Not(w) for w in written])),
                   *[z3.Implies(w, s2[i]) for i, w in enumerate(written)])
    return prove_claim("a remembered hit never serves bytes the store no longer holds",
                  [r >= 0, r <= N], claim)


def remembered_lemmas() -> list[LemmaResult]:
    """The remembered-lookup lemmas, in table order."""
    return [remembered_equals_fresh(), unchanged_answer_stands(),
            remembered_never_serves_gone_bytes()]


# ---------------------------------------------------------------- seeded mutants
def reask_ignores_reports(s0: Bools, s1: Bools, reported: z3.BoolRef) -> z3.ArithRef:
    """Seeded bug: the memo is trusted after a reported removal too."""
    return reask(s0, s1, z3.BoolVal(False))


def ask_kept_without_removals(s0: Bools, s1: Bools, reported: z3.BoolRef,
                              unchanged: z3.BoolRef) -> z3.ArithRef:
    """Seeded bug: the memo is answered without asking whenever no removal was reported
    (puts since the last ask are missed)."""
    return z3.If(z3.Not(reported), prefix(s0), reask(s0, s1, reported))


def load_per_key(r: z3.ArithRef, s2: Bools) -> tuple[z3.BoolRef, list[z3.BoolRef]]:
    """Seeded bug: each present key is written and the load reports success (a hole)."""
    return z3.BoolVal(True), [z3.And(i < r, s2[i]) for i in range(len(s2))]


def remembered_mutants() -> dict[str, list[LemmaResult]]:
    """Mutated re-asks and loads, each of which a remembered-lookup lemma must refute."""
    return {
        "memo_ignores_reported_removal": [remembered_equals_fresh(reask_ignores_reports)],
        "memo_kept_without_removals": [unchanged_answer_stands(ask_kept_without_removals)],
        "load_writes_per_key": [remembered_never_serves_gone_bytes(ld=load_per_key)],
    }
