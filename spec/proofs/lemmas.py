"""Boundary lemmas proven with z3 for all values (unbounded integers) of the functions in
:mod:`spec.arithmetic` -- the very functions the reference model runs on ints.

Each lemma builds the negation of its claim over symbolic integers and asks z3 for a model;
``unsat`` is a proof, ``sat`` a counterexample, ``unknown`` (timeout) neither. Lemmas take the
arithmetic functions as parameters so a seeded mutant of them can be checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from .. import arithmetic as ar
from .offsets import offset_lemmas, offset_mutants
from .remembered import remembered_lemmas, remembered_mutants
from .solve import TIMEOUT_MS, LemmaResult, prove_claim

__all__ = ["TIMEOUT_MS", "LemmaResult", "all_lemmas", "lemma_mutants"]

def _ints(names: str) -> list[z3.ArithRef]:
    return list(z3.Ints(names))


CkFn = Callable[..., object]


def ck_multiple_of_h(ck: CkFn = ar.checkpoint_position) -> LemmaResult:
    """ck(P) is a multiple of h, for every P >= 1, h >= 1, lookahead L >= 0, with and without
    EAGLE: the tail key sits on a hash boundary a lookup can ask for."""
    p, h, la = _ints("P h L")
    e = z3.Bool("eagle")
    c = ck(p, h, e, la)
    return prove_claim("ck(P) % h == 0", [p >= 1, h >= 1, la >= 0], c % h == 0)


def ck_below_p(ck: CkFn = ar.checkpoint_position) -> LemmaResult:
    """0 <= ck(P) < P: the tail leaves at least the last prompt token to recompute (a resend of
    the same prompt can hit it; a chunk can end there before the prompt ends)."""
    p, h, la = _ints("P h L")
    e = z3.Bool("eagle")
    c = ck(p, h, e, la)
    return prove_claim("0 <= ck(P) < P", [p >= 1, h >= 1, la >= 0], z3.And(c >= 0, c < p))


def ck_largest(ck: CkFn = ar.checkpoint_position) -> LemmaResult:
    """ck(P) is the largest such boundary: every multiple m of h with m <= P - max(1, L)
    (non-EAGLE) or m + h <= P (EAGLE) is <= ck(P). No longer hit was possible."""
    p, h, la, m = _ints("P h L m")
    e = z3.Bool("eagle")
    c = ck(p, h, e, la)
    lim = z3.If(e, p - h, p - z3.If(la >= 1, la, 1))
    return prove_claim("ck(P) is the largest admissible boundary",
                  [p >= 1, h >= 1, la >= 0, m >= 0, m % h == 0, m <= lim], m <= c)


def aligned_hit_servable(align: Callable[[int, int, bool], int] = ar.hit_alignment,
                         partials: tuple[bool, ...] = (True, False), lookup: bool = True
                         ) -> list[LemmaResult]:
    """A hit n that is a multiple of A (= h with partial hits, the lcm otherwise) ends on an
    h-boundary inside block ``cdiv(n, B) - 1`` of every group (so a key for it exists in that
    block: its block-end hash or an interior sub-hash), and on a block end of every group when
    partial hits are off. The lookup's own floor (``aligned_lookup_length``) is such a hit."""
    out = []
    for partial in partials:
        n, h, b, k, j, t = _ints("n h b k j t")
        bs = h * b  # h divides every group's block size
        lcm = bs * k  # every block size divides the lcm
        a = align(h, lcm, partial)
        last = ar.cdiv(n, bs) - 1
        claim = z3.And(n % h == 0, last * bs < n, n <= (last + 1) * bs)
        if not partial:
            claim = z3.And(claim, n % bs == 0)
        hyps = [h >= 1, b >= 1, k >= 1, j >= 1, n == a * j]
        out.append(prove_claim(f"A-aligned hit servable (partial={partial})", hyps, claim))
        if not lookup:
            continue
        f = ar.aligned_lookup_length(t, a)
        out.append(prove_claim(f"aligned_lookup_length is A-aligned (partial={partial})",
                          [h >= 1, b >= 1, k >= 1, t >= 0],
                          z3.And(f % a == 0, f <= t, t - f < a)))
    return out


def tail_put_covers(tail: Callable = ar.tail_put_range) -> list[LemmaResult]:
    """The attention tail puts ``tail_put_range(ck, lcm, B, margin)`` start exactly at the lcm
    floor (where normal saves stop, they emit only whole lcm chunks) and cover every block of a
    smaller group (B | lcm) that holds tokens below ``ck + margin``: normal saves plus tail puts
    leave no block out. Margin 0 (no EAGLE) and the EAGLE margin of the group."""
    out = []
    for eagle in (False, True):
        n, h, b, k, i, f = _ints("n h b k i f")
        bs = h * b
        lcm = bs * k
        margin = ar.eagle_proof_margin(bs, h, f == 1) if eagle else 0
        lo, hi = tail(n, lcm, bs, margin)
        saved_end = ar.round_down(n, lcm)  # normal saves cover [0, saved_end)
        covered = z3.Or((i + 1) * bs <= saved_end, z3.And(lo <= i, i < hi))
        hyps = [h >= 1, b >= 1, k >= 1, n >= 1, n % h == 0, i >= 0, i * bs < n + margin,
                z3.Or(f == 0, f == 1)]
        out.append(prove_claim(f"tail puts cover smaller-group blocks (eagle={eagle})", hyps,
                          z3.And(covered, lo * bs == saved_end)))
    return out


def clip_monotone(clip: Callable = ar.clip_joint_hit) -> list[LemmaResult]:
    """Clipping a joint hit is monotone in every argument, never exceeds any group's hit, and an
    A-aligned candidate and group hits give an A-aligned result (a boundary every group serves,
    by ``aligned_hit_servable``)."""
    c, g1, g2, c2, h1, h2, a = _ints("c g1 g2 c2 h1 h2 a")
    x, y = clip(c, [g1, g2]), clip(c2, [h1, h2])
    mono = prove_claim("clip monotone", [c <= c2, g1 <= h1, g2 <= h2], x <= y)
    below = prove_claim("clip <= every group hit", [], z3.And(x <= c, x <= g1, x <= g2))
    aligned = prove_claim("clip of A-aligned hits is A-aligned",
                     [a >= 1, c % a == 0, g1 % a == 0, g2 % a == 0], x % a == 0)
    return [mono, below, aligned]


def truncation_divides() -> list[LemmaResult]:
    """The waiting-request arbitration truncates a local hit to
    ``hit - hit % lcm = round_down(hit, lcm)``; that endpoint is a whole number of blocks of
    every group (``truncate_computed_blocks`` asserts ``n % bs == 0``) and drops less than one
    lcm. Divisibility is stated as an explicit multiple (``end == q * bs``), which z3 proves as
    a ring identity where ``%`` of a product would send it into nonlinear search."""
    n, h, b1, b2, k1, k2 = _ints("n h b1 b2 k1 k2")
    bs1, bs2 = h * b1, h * b2
    lcm = bs1 * k1
    end = ar.round_down(n, lcm)
    q = ar.floor_div(n, lcm)
    hyps = [h >= 1, b1 >= 1, b2 >= 1, k1 >= 1, k2 >= 1, lcm == bs2 * k2, n >= 0]
    return [
        prove_claim("truncation endpoint is whole blocks of every group", hyps,
               z3.And(end == (q * k1) * bs1, end == (q * k2) * bs2)),
        prove_claim("truncation endpoint = hit - hit % lcm, within one lcm", hyps,
               z3.And(end <= n, n - end < lcm, end == n - n % lcm)),
    ]


def lookup_leaves_last_token(bound_fn: Callable = ar.max_cache_hit_length) -> LemmaResult:
    """With vLLM 0.34's clamp (``Request.get_max_cache_hit_length``) a lookup's hit, however
    large the explicit bound, leaves at least the last token to compute (its logits), and never
    exceeds the bound: ``allocate_slots`` always gets a token to schedule."""
    n, bound, a = _ints("n bound A")
    hit = ar.aligned_lookup_length(bound_fn(n, bound, z3.BoolVal(True)), a)
    return prove_claim("a clamped lookup leaves the last token", [n >= 1, bound >= 0, a >= 1],
                       z3.And(hit < n, hit <= bound))


def all_lemmas() -> list[LemmaResult]:
    """Every boundary lemma, in table order."""
    out = [ck_multiple_of_h(), ck_below_p(), ck_largest()]
    out += aligned_hit_servable()
    out += tail_put_covers()
    out += clip_monotone()
    out += truncation_divides()
    out += [lookup_leaves_last_token()]
    out += remembered_lemmas()
    out += offset_lemmas()
    return out


# ---------------------------------------------------------------- mutated arithmetic
def ck_off_by_one(num_tokens, h, drop_eagle, lookahead=0):  # noqa: ANN001, ANN201
    """Seeded bug: ck(P) of P+1 (the recomputed last token forgotten)."""
    return ar.checkpoint_position(num_tokens + 1, h, drop_eagle, lookahead)


def alignment_unfloored(h, scheduler_block_size, partial_hits):  # noqa: ANN001, ANN201
    """Seeded bug: with partial hits off, hits aligned to h instead of the lcm."""
    return h


def tail_from_boundary(boundary, lcm, block_size, margin):  # noqa: ANN001, ANN201
    """Seeded bug: tail puts start at the boundary's own block, not at the lcm floor."""
    return ar.floor_div(boundary, block_size), ar.cdiv(boundary + margin, block_size)


def bound_unclamped(num_tokens, bound, clamp):  # noqa: ANN001, ANN201
    """Seeded bug (vLLM 0.33's rule under 0.34): the explicit bound is used as given."""
    return bound


def lemma_mutants() -> dict[str, list[LemmaResult]]:
    """Mutated arithmetic, each of which some lemma must refute."""
    return {
        "ck_off_by_one": [ck_below_p(ck_off_by_one)],
        "hit_unaligned": aligned_hit_servable(alignment_unfloored, (False,), lookup=False),
        "tail_from_boundary": tail_put_covers(tail_from_boundary),
        "bound_unclamped": [lookup_leaves_last_token(bound_unclamped)],
        **remembered_mutants(),
        **offset_mutants(),
    }
