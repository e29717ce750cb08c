"""Induction step (1-induction on an inductive strengthening), proven with z3 for all depths.

The accounting invariants are per block: whatever the other blocks do, one block's
``ref``, free-queue membership and holder counts change only through a handful of atomic
operations, which are exactly the places :mod:`spec.model` (and vLLM 0.33) touch ``ref_cnt``:

* ``touch(kind)``          -- ``BlockPool.touch``: hit adoption (T), connector pin (P);
* ``get_new(kind)``        -- ``BlockPool.get_new_blocks``: pops a queued ref-0 block;
* ``extra_ref``            -- ``_apply_cow``'s ``cow.ref_cnt += 1`` / running CoW's
                              ``source.ref_cnt += 1`` on a block already held (R);
* ``transfer(k1, k2)``     -- a holder changes kind without a ref change (a first-allocation CoW
                              turns the source's table ref into its retention; a drained copy's
                              retention becomes a deferred-free entry);
* ``free(kind)``           -- ``BlockPool.free_blocks`` of one holder (table, retention, pin);
* ``reset``                -- succeeds only if the block is free; keys/moves/writes don't count.

For a symbolic block with unbounded counts the lemma ``Inv /\\ op -> Inv'`` is proven for
every op, so I1 (ref == holders), I2 (queued iff ref 0) and I3 (held blocks never handed out)
hold at every depth for every pool size. Likewise the store-job pin counter (I14) and the
pressure gate (I18). The link to the concrete model -- that its transitions are compositions
of these ops -- is by construction and is re-checked to the bound by the explicit search.
"""

from __future__ import annotations

import time

import z3

from .solve import LemmaResult

KINDS = ("T", "R", "P")  # table, retention (incl. deferred frees), pin


def _block(tag: str) -> dict[str, z3.ExprRef]:
    v: dict[str, z3.ExprRef] = {k: z3.Int(f"{k}{tag}") for k in KINDS}
    v["ref"] = z3.Int(f"ref{tag}")
    v["inq"] = z3.Bool(f"inq{tag}")
    return v


def _inv(v: dict[str, z3.ExprRef]) -> z3.BoolRef:
    return z3.And(*[v[k] >= 0 for k in KINDS], v["ref"] == sum(v[k] for k in KINDS),
                  v["inq"] == (v["ref"] == 0))


def _same(a: dict, b: dict, but: tuple[str, ...] = ()) -> list[z3.BoolRef]:
    return [a[k] == b[k] for k in (*KINDS, "ref", "inq") if k not in but]


def _ops(s: dict, t: dict, mutant: str | None) -> list[tuple[str, z3.BoolRef]]:
    ops: list[tuple[str, z3.BoolRef]] = []
    for k in KINDS:
        ops.append((f"touch({k})", z3.And(t["ref"] == s["ref"] + 1, t[k] == s[k] + 1,
                                           z3.Not(t["inq"]), *_same(s, t, (k, "ref", "inq")))))
        # popleft only sees queued blocks and asserts ref 0; holders of other kinds (if any)
        # are untouched -- which the invariant makes vacuous unless the guard is dropped
        guard = z3.And(s["inq"], s["ref"] == 0) if mutant != "pop_held" else z3.BoolVal(True)
        ops.append((f"get_new({k})", z3.And(guard, t["ref"] == 1, t[k] == s[k] + 1,
                                             z3.Not(t["inq"]),
                                             *[t[o] == s[o] for o in KINDS if o != k])))
        dec = 2 if mutant == "double_free" else 1
        ops.append((f"free({k})", z3.And(s[k] >= 1, t["ref"] == s["ref"] - dec,
                                          t[k] == s[k] - 1,
                                          t["inq"] == z3.If(t["ref"] == 0, True, s["inq"]),
                                          *_same(s, t, (k, "ref", "inq")))))
        for k2 in KINDS:
            if k2 != k:
                ops.append((f"transfer({k}->{k2})", z3.And(
                    s[k] >= 1, t[k] == s[k] - 1, t[k2] == s[k2] + 1,
                    *_same(s, t, (k, k2)))))
    ops.append(("extra_ref", z3.And(s["ref"] >= 1, t["ref"] == s["ref"] + 1, t["R"] == s["R"] + 1,
                                    *_same(s, t, ("R", "ref")))))
    ops.append(("reset", z3.And(s["ref"] == 0, *_same(s, t))))
    return ops


def _check(name: str, pre: z3.BoolRef, step: z3.BoolRef, post: z3.BoolRef) -> z3.CheckSatResult:
    solver = z3.Solver()
    solver.set("timeout", 10_000)
    solver.add(pre, step, z3.Not(post))
    return solver.check()


def refcount_induction(mutant: str | None = None) -> LemmaResult:
    """I1+I2+I3 per block: every atomic op preserves ``ref == T+R+P >= 0`` and
    ``in_free_queue <=> ref == 0`` (so ``get_new`` -- guarded by queue membership -- never pops
    a held block)."""
    t0 = time.monotonic()
    s, t = _block("0"), _block("1")
    bad = [n for n, op in _ops(s, t, mutant) if _check(n, _inv(s), op, _inv(t)) != z3.unsat]
    name = "I1/I2/I3 refcount+free queue, per block"
    res = "proved" if not bad else "counterexample"
    return LemmaResult(name, res, time.monotonic() - t0, ",".join(bad) or None)


def pin_induction(mutant: str | None = None) -> LemmaResult:
    """I14 per store job: with W >= 1 ranks, ``pinned <=> reported < W`` and
    ``0 <= reported <= ran <= W`` are preserved by run (a rank runs once), report (a rank that
    ran reports once; the last report unpins) -- so pins are released exactly once, after
    every rank."""
    t0 = time.monotonic()
    w, ran, rep, ran1, rep1 = z3.Ints("W ran rep ran1 rep1")
    pin, pin1 = z3.Bools("pinned pinned1")

    def inv(ra: z3.ArithRef, rp: z3.ArithRef, pn: z3.BoolRef) -> z3.BoolRef:
        return z3.And(w >= 1, 0 <= rp, rp <= ra, ra <= w, pn == (rp < w))

    unpin_at = 1 if mutant == "early_unpin" else w
    run = z3.And(ran < w, ran1 == ran + 1, rep1 == rep, pin1 == pin)
    report = z3.And(rep < ran, ran1 == ran, rep1 == rep + 1,
                    pin1 == z3.And(pin, rep1 < unpin_at))
    bad = [n for n, op in (("run", run), ("report", report))
           if _check(n, inv(ran, rep, pin), op, inv(ran1, rep1, pin1)) != z3.unsat]
    return LemmaResult("I14 pin released once, after every rank", "proved" if not bad
                       else "counterexample", time.monotonic() - t0, ",".join(bad) or None)


def pressure_induction(mutant: str | None = None) -> LemmaResult:
    """I18 for an arbitrary request: ``in_skip => pressure`` is preserved by mark (-200 of a
    live job: flag first, then the request), clear (first full success: both) and the gate
    check (no change)."""
    t0 = time.monotonic()
    p0, s0, p1, s1, live, mine = z3.Bools("p0 s0 p1 s1 live mine")
    flag = p0 if mutant == "mark_skip_only" else z3.BoolVal(True)
    mark = z3.And(p1 == flag, s1 == z3.Or(s0, z3.And(live, mine)))
    clear = z3.And(z3.Not(p1), z3.Not(s1))
    gate = z3.And(p1 == p0, s1 == s0)
    inv0, inv1 = z3.Implies(s0, p0), z3.Implies(s1, p1)
    bad = [n for n, op in (("mark", mark), ("clear", clear), ("gate", gate))
           if _check(n, inv0, op, inv1) != z3.unsat]
    return LemmaResult("I18 skip set only under pressure", "proved" if not bad
                       else "counterexample", time.monotonic() - t0, ",".join(bad) or None)


def held_corollary() -> LemmaResult:
    """The block side of I7 and I8 follows from the inductive invariant: a block with a
    retention (an undrained copy endpoint) or a pin has ref >= 1 and is not in the free queue,
    so no allocation can hand it out before the copy ran / every rank read it."""
    t0 = time.monotonic()
    v = _block("0")
    claim = z3.Implies(z3.Or(v["R"] >= 1, v["P"] >= 1), z3.And(v["ref"] >= 1, z3.Not(v["inq"])))
    r = _check("held", _inv(v), z3.BoolVal(True), claim)
    return LemmaResult("I7/I8 block side: retained or pinned => held, not queued",
                       "proved" if r == z3.unsat else "counterexample", time.monotonic() - t0)


def all_induction() -> list[LemmaResult]:
    """Every induction step, in table order."""
    return [refcount_induction(), held_corollary(), pin_induction(), pressure_induction()]


def induction_mutants() -> dict[str, LemmaResult]:
    """Seeded bugs in the atomic ops that the induction step must refute."""
    return {
        "double_free": refcount_induction("double_free"),
        "early_unpin": pin_induction("early_unpin"),
        "pop_held": refcount_induction("pop_held"),
        "mark_skip_only": pressure_induction("mark_skip_only"),
    }
