"""Boundary arithmetic of partial-tail caching, written once and generic over its numbers.

The reference model evaluates these functions on Python ints; ``spec/z3`` proves lemmas about
the very same functions on z3 integer terms (a proof about a copy proves nothing about the
original). Only ``+ - * // %``, comparisons and the helpers ``floor_div``/``ite``/``max2``/``min2``
are used, each dispatching on the operand type. Non-negative operands are assumed throughout.
"""

from __future__ import annotations

from math import gcd
from typing import Any

Num = Any  # an int, or a z3 ArithRef / BoolRef when proving


def _is_symbolic(*xs: Num) -> bool:
    for x in xs:
        t = type(x)
        if t is not int and t is not bool and t.__module__.startswith("z3"):
            return True
    return False


def floor_div(a: Num, b: Num) -> Num:
    """a // b for non-negative a and positive b (z3 integer ``/`` agrees there)."""
    if type(a) is int and type(b) is int:  # the models' hot path: plain ints
        return a // b
    return a / b if _is_symbolic(a, b) else a // b


def ite(cond: Num, a: Num, b: Num) -> Num:
    """``a if cond else b``, symbolic-safe."""
    if type(cond) is bool:  # a concrete condition picks its branch, whatever the branches are
        return a if cond else b
    if _is_symbolic(cond, a, b):
        import z3

        return z3.If(cond, a, b)
    return a if cond else b


def max2(a: Num, b: Num) -> Num:
    return ite(a >= b, a, b)


def min2(a: Num, b: Num) -> Num:
    return ite(a <= b, a, b)


def cdiv(a: Num, b: Num) -> Num:
    """Ceiling division, mirrors ``vllm.utils.math_utils.cdiv``."""
    return floor_div(a + b - 1, b)


def round_down(a: Num, m: Num) -> Num:
    return floor_div(a, m) * m


def lcm_all(sizes: list[int]) -> int:
    """Scheduler block size of a hybrid model: the lcm of the group block sizes
    (mirrors ``kv_cache_utils.resolve_kv_cache_block_sizes``)."""
    out = 1
    for s in sizes:
        out = out * s // gcd(out, s)
    return out


def checkpoint_position(num_tokens: Num, h: Num, drop_eagle: Num, lookahead: Num = 0) -> Num:
    """ck(P): the Mamba partial-tail boundary of a prompt of ``num_tokens`` tokens.

    Mirrors ``vllm.v1.kv_cache_interface.get_mamba_prefill_checkpoint_position``: the largest
    multiple of h that leaves at least one token (or the hash lookahead) to recompute; with
    EAGLE's block drop, one hash unit below the floor of P.
    """
    proof_limit = ite(drop_eagle, num_tokens, num_tokens - max2(1, lookahead))
    pos = round_down(proof_limit, h)
    pos = ite(drop_eagle, pos - h, pos)
    return max2(pos, 0)


def eagle_proof_margin(block_size: Num, h: Num, fine_grained: Num) -> Num:
    """Tokens an EAGLE group matches past a hit before dropping them
    (mirrors ``kv_cache_utils.eagle_proof_margin``)."""
    return ite(fine_grained, ite(block_size > h, h, block_size), block_size)


def hit_alignment(h: int, scheduler_block_size: int, partial_hits: bool) -> int:
    """A: the unit every cache hit is a multiple of (``HybridKVCacheCoordinator``, CO:709-716)."""
    return h if partial_hits else scheduler_block_size


def fine_grained(block_size: Num, alignment: Num) -> Num:
    """Whether a group probes inside a block (``FullAttentionManager.find_longest_cache_hit``)."""
    if _is_symbolic(block_size, alignment):
        import z3

        return z3.And(alignment < block_size, block_size % alignment == 0)
    return alignment < block_size and block_size % alignment == 0


def aligned_lookup_length(num_tokens: Num, alignment: Num) -> Num:
    """Longest length a lookup may report: floor to A (``MooncakeStoreCoordinator``)."""
    return round_down(num_tokens, alignment)


def max_cache_hit_length(num_tokens: Num, bound: Num, clamp: Num) -> Num:
    """The longest hit a lookup with an explicit ``bound`` may return: the bound as given
    (vLLM 0.33 ``KVCacheManager.get_computed_blocks``), or clamped to ``num_tokens - 1`` so
    the last token is always recomputed (vLLM 0.34 ``Request.get_max_cache_hit_length``)."""
    return ite(clamp, min2(num_tokens - 1, bound), bound)


def tail_put_range(boundary: Num, lcm: Num, block_size: Num, margin: Num) -> tuple[Num, Num]:
    """Block index range ``[first, end)`` of a smaller group's attention tail puts.

    Normal saves stop at the lcm floor, so blocks from ``floor(boundary, lcm)`` up to the
    boundary plus the EAGLE proof margin are put explicitly
    (mirrors ``mooncake.store.scheduler._partial_tail_non_mamba_puts``).
    """
    start = round_down(boundary, lcm)
    proof_end = boundary + margin
    return floor_div(start, block_size), cdiv(proof_end, block_size)


def clip_joint_hit(candidate: Num, group_hits: list[Num]) -> Num:
    """A joint hybrid hit: the smallest of the per-group hits, never above the candidate."""
    out = candidate
    for g in group_hits:
        out = min2(out, g)
    return out


def partial_hash_hits_enabled(mamba_block_sizes: list[int], h: int, hybrid: bool) -> bool:
    """Whether hits may land on h inside a block (mirrors ``kv_cache_utils.
    partial_hash_hits_enabled`` with DCP 1 and full-attention + Mamba-align managers, both
    fine-grained): some Mamba-align group has a block larger than h. Only the hybrid
    coordinator turns it on (``HybridKVCacheCoordinator.__init__``, CO:694)."""
    return hybrid and any(bs > h for bs in mamba_block_sizes)


NULL_BLOCK_ID = 0


def partial_tail_puts(
    *, num_prompt_tokens: int, completed_token_len: int, num_hashes: int,
    publish_partial_tail: bool, mamba_tail_boundaries: list[int],
    block_ids: tuple[list[int], ...], block_sizes: tuple[int, ...], is_mamba: tuple[bool, ...],
    eagle_margins: tuple[int, ...], hash_block_size: int, scheduler_block_size: int,
    use_eagle: bool,
) -> list[tuple[int, int, int]]:
    """Attention blocks a partial tail publishes, as ``(group, block id, num_tokens)`` (mirrors
    ``mooncake.store.scheduler._partial_tail_non_mamba_puts``, MS:62-132).

    Due when the job publishes the prompt tail or carries the Mamba sub-block tail at
    ``ck(P)`` (``mamba_tail_boundaries``: its Mamba boundary puts that are not block-aligned).
    Per non-Mamba group: the blocks ``tail_put_range`` names, keyed at their end clipped to the
    proof end ``ck(P) + margin``; null blocks are skipped and a group whose proof is not yet
    computed is omitted. Written once for the reference (``reference.connector.tail``) and the
    connector (``impl.scheduler_side``); the corpus checks it against vLLM's own function on
    the ``vllm-mooncake`` adapter.

    vLLM's own example (MS:62-132): h = 4, attention blocks of 4, Mamba blocks of 16, so the
    scheduler block (lcm) is 16; a 45-token prompt has ck(P) = 44. Normal saves stop at the
    lcm floor, 32; the tail puts are the attention blocks from there up to ck(P) plus the
    group's EAGLE proof margin, each keyed at its end clipped to that proof end; the Mamba
    state at ck(P) is the core's hand-off, a boundary put of its own (not listed here)::

        token       0   4   8   12  16  20  24  28  32  36  40  44  48
                    |   |   |   |   |   |   |   |   |   |   |   |   |
        prompt      |============================================| P = 45
        attention   |b0 |b1 |b2 |b3 |b4 |b5 |b6 |b7 |b8 |b9 |b10|b11| blocks of 4 (= h)
        Mamba       |       m0      |       m1      |       m2      | blocks of 16
        lcm         |<----- 0 ----->|<----- 1 ----->|<----- 2 ----->| scheduler blocks
        ck(P)                                                   ^ 44
        saved       |===============================| floor(ck, lcm) = 32
        tail puts                                   |b8 |b9 |b10|     [32, ck + margin)
          key                                           36  40  44
        Mamba put                                               * m2 (state at 44)
        EAGLE                                       |b8 |b9 |b10|b11| P = 49: ck 44, margin 4
          key                                           36  40  44  48 = proof end
    """
    if not mamba_tail_boundaries and not publish_partial_tail:
        return []
    h = hash_block_size
    # The core drops the checkpoint whenever EAGLE block drop is on (MS:102-106).
    boundary = int(checkpoint_position(num_prompt_tokens, h, use_eagle))
    # Any other sub-block hand-off is a shared-prefix junction: no attention tail (MS:110).
    if not publish_partial_tail and boundary not in mamba_tail_boundaries:
        return []
    if boundary == 0 or boundary // h > num_hashes:
        return []
    puts: list[tuple[int, int, int]] = []
    for g, bs in enumerate(block_sizes):
        if is_mamba[g]:
            continue
        margin = eagle_margins[g]
        proof_end = boundary + margin
        if proof_end > completed_token_len or proof_end // h > num_hashes:
            continue
        first, end = tail_put_range(boundary, scheduler_block_size, bs, margin)
        table = block_ids[g]
        for idx in range(first, min(end, len(table))):
            if table[idx] != NULL_BLOCK_ID:
                puts.append((g, table[idx], min((idx + 1) * bs, proof_end)))
    return puts


# --------------------------------------------------------------------------- turn-end checkpoints
# The reuse extension (docs/reuse.md), not vLLM 0.33: written once here for the reference
# connector model and ``impl.scheduler_side``, like ``partial_tail_puts``.


def snapshot_due(num_tokens: Num, num_prompt_tokens: Num, h: Num, drop_eagle: Num) -> Num:
    """Whether a step that leaves a request with ``num_tokens`` computed (real) tokens ends on a
    hash boundary past the prompt's own checkpoint ck(P) (which vLLM 0.33 already stores): the
    running Mamba state then equals the state of the prefix ``num_tokens`` long."""
    ck = checkpoint_position(num_prompt_tokens, h, drop_eagle)
    if _is_symbolic(num_tokens, num_prompt_tokens, h, drop_eagle):
        import z3

        return z3.And(num_tokens % h == 0, num_tokens > ck)
    return num_tokens % h == 0 and num_tokens > ck


def running_state_index(num_tokens: Num, mamba_block_size: Num) -> Num:
    """Table index of the Mamba ``align`` block holding the state after ``num_tokens`` tokens
    (``MambaManager``: entry i holds the state after (i+1)*B tokens, or the running state)."""
    return cdiv(num_tokens, mamba_block_size) - 1


def turn_end_attention_puts(
    *, boundary: int, saved_tokens: int, completed_token_len: int, num_hashes: int,
    block_ids: tuple[list[int], ...], block_sizes: tuple[int, ...], is_mamba: tuple[bool, ...],
    eagle_margins: tuple[int, ...], hash_block_size: int,
) -> list[tuple[int, int, int]]:
    """Attention blocks a turn-end checkpoint at ``boundary`` publishes, as ``(group, block id,
    num_tokens)``: per non-Mamba group, every block from the last normal save
    (``saved_tokens``, lcm-floored) up to ``boundary`` plus the group's EAGLE proof margin, keyed
    at its end clipped to that proof end (the keys a normal save or a prompt tail would use);
    null blocks are skipped and a group whose proof end is not computed or hashed is omitted
    (the lookup then stops below ``boundary``: a miss, never wrong bytes)."""
    h = hash_block_size
    puts: list[tuple[int, int, int]] = []
    for g, bs in enumerate(block_sizes):
        if is_mamba[g]:
            continue
        proof_end = boundary + eagle_margins[g]
        if proof_end > completed_token_len or proof_end // h > num_hashes:
            continue
        table = block_ids[g]
        for idx in range(saved_tokens // bs, min(cdiv(proof_end, bs), len(table))):
            if table[idx] != NULL_BLOCK_ID:
                puts.append((g, table[idx], min((idx + 1) * bs, proof_end)))
    return puts
