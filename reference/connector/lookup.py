"""Lookups: what the store can serve, and how the scheduler weighs it against a local hit.

Store side mirrors ``MooncakeStoreWorker.lookup`` (MW:2095-2209): candidate keys up to the
aligned length, a key counts only if every rank's namespace has it, the hybrid hit is the
longest prefix every group can serve (``MooncakeStoreCoordinator._find_hit_blocks``, MCO:391-510,
which runs the core managers' own finders: here the reference core's), a hit covering the whole
request is re-derived below ``align(num_tokens - 1)``, and each group's tail key boundary is
located (``_tail_key_boundaries``, MW:2211-2255). Scheduler side mirrors
``get_num_new_matched_tokens`` (MS:210-265) and the remote-vs-local rule of
``Scheduler.schedule`` (SC:1129-1190).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailproof.reference.block_pool import Block
from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.masks import lookup_mask
from tailproof.reference.connector.meta import LoadSpec, TailKeyBoundary
from tailproof.reference.coordinator import find_group_hit
from tailproof.reference.geometry import FULL_ATTENTION, MAMBA_ALIGN, SpecGroup
from tailproof.spec.arithmetic import cdiv, eagle_proof_margin


class ExternalCachedBlockPool:
    """Duck-typed block pool over a ``(group, digest)`` exists set (MCO:46-80)."""

    def __init__(self, h: int, exists: set[tuple[int, bytes]]) -> None:
        self.hash_block_size = h
        self.exists = exists
        self.null_block = Block(0)
        self.null_block.is_null = True
        self._present = Block(1)

    def get_cached_block(self, digest: bytes, boundary: int,
                         group_ids: Sequence[int]) -> list[Block] | None:
        if all((g, bytes(digest)) in self.exists for g in group_ids):
            return [self._present] * len(group_ids)
        return None

    def contains(self, gid: int, digest: bytes) -> bool:
        return (gid, bytes(digest)) in self.exists


def _finder(geo: StoreGeometry, sg: SpecGroup, hashes: list[bytes], max_length: int,
            pool: ExternalCachedBlockPool, drop: bool) -> int:
    """The hit length of the spec group's manager class (the reference core's finders)."""
    _, hit = find_group_hit(sg.kind, hashes, max_length, sg.group_ids, pool,
                       sg.block_size, drop, geo.alignment, sg.sliding_window)
    return hit


def find_hit(geo: StoreGeometry, hashes: Sequence[bytes], max_length: int,
             pool: ExternalCachedBlockPool) -> int:
    """The hybrid fixed point of ``MooncakeStoreCoordinator._find_hit_blocks`` (eagle on)."""
    groups = geo.attention_groups
    hl = list(hashes)
    if len(groups) == 1:
        return _finder(geo, groups[0], hl, max_length, pool, groups[0].use_eagle)
    hit_length = max_length
    group_hit: dict[int, int] = {}
    simple = len(groups) == 2 and groups[0].kind == FULL_ATTENTION
    verified: set[int] = set()
    while True:
        curr = hit_length
        for idx, sg in enumerate(groups):
            if sg.kind == FULL_ATTENTION and idx in group_hit:
                curr = min(curr, group_hit[idx])  # full attention is downward closed
                continue
            drop = sg.use_eagle and idx not in verified
            bound = curr
            if drop and sg.kind != MAMBA_ALIGN:  # no peek margin for Mamba (#43559)
                # a fine-grained margin only where the manager supports fine lookups (FA)
                margin = eagle_proof_margin(sg.block_size, geo.hash_block_size,
                                            geo.partial_hits and sg.kind == FULL_ATTENTION)
                bound = min(curr + margin, len(hl) * geo.hash_block_size)
            new = _finder(geo, sg, hl, bound, pool, drop)
            if drop:
                verified.add(idx)
            elif new < curr:
                verified.clear()
            curr = new
            group_hit[idx] = new
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    return hit_length


def candidate_units(geo: StoreGeometry, num_hashes: int, token_len: int) -> dict[int, list[int]]:
    """Hash-unit indices each group probes (MW:2118-2147): every unit below the aligned length
    with partial hits, else the block-end unit of each chunk ``lookup_mask`` keeps (a sliding
    window probes only the blocks a hit at an lcm boundary can use)."""
    h = geo.hash_block_size
    out: dict[int, list[int]] = {}
    masks = None if geo.partial_hits else lookup_mask(geo, token_len)
    for gid, bs in enumerate(geo.block_sizes):
        if masks is None:
            out[gid] = list(range(min(num_hashes, token_len // h)))
            continue
        scale = bs // h
        limit = min(num_hashes // scale, cdiv(token_len, bs))
        mask = masks[gid]
        if mask is not None:
            limit = min(limit, len(mask))
        out[gid] = [(c + 1) * scale - 1 for c in range(limit) if mask is None or mask[c]]
    return out


@dataclass(frozen=True)
class LookupResult:
    """``MooncakeLookupResult`` (MD:673-688)."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


def store_lookup(geo: StoreGeometry, num_tokens: int, hashes: Sequence[bytes],
                 present: Callable[[int, bytes], bool]) -> LookupResult:
    """``MooncakeStoreWorker.lookup``; ``present(group, digest)``: every rank has the key."""
    token_len = geo.align_lookup_length(num_tokens)
    if not hashes or token_len <= 0:
        return LookupResult(0)
    exists = {(gid, bytes(hashes[u])) for gid, units in
              candidate_units(geo, len(hashes), token_len).items()
              for u in units if present(gid, bytes(hashes[u]))}
    pool = ExternalCachedBlockPool(geo.hash_block_size, exists)
    hit = find_hit(geo, hashes, token_len, pool)
    if hit >= num_tokens:
        usable = geo.align_lookup_length(num_tokens - 1)
        if usable <= 0:
            return LookupResult(0)
        hit = find_hit(geo, hashes, usable, pool)
    return LookupResult(hit, tail_key_boundaries(geo, hashes, hit, pool))


@dataclass(frozen=True)
class LookupMemo:
    """What the connector remembers of a waiting request's last lookup (not vLLM 0.33): its
    length, the store's removal and change counts then, the candidate keys found present and
    the answer."""

    num_tokens: int
    removals: int | None
    found: frozenset[tuple[int, bytes]]
    changes: int | None = None
    result: LookupResult | None = None


def remembered_lookup(geo: StoreGeometry, num_tokens: int, hashes: Sequence[bytes],
                      present: Callable[[int, bytes], bool], removals: int | None,
                      memo: LookupMemo | None,
                      changes: int | None = None) -> tuple[LookupResult, LookupMemo]:
    """The remembered-lookup rule (docs/connector-ops.md, "Remembered lookups"): a key found
    present by an earlier ask of the same request is taken as present, unless the store
    reported a removal since (then every key is asked again); every other key is asked now.
    Keys are only added between reported removals, so the answer is ``store_lookup``'s; where
    removals go unreported (``removals`` None) a remembered key may be gone, and the load of
    such a hit fails closed (``worker``: all or nothing), never serving other bytes. A store
    that counts every key it adds or drops (``changes``) and reports no change since the last
    ask is asked nothing: every answer stands, so the last answer is the fresh one."""
    same = memo is not None and memo.num_tokens == num_tokens and (
        removals is None or memo.removals == removals)
    if same and changes is not None and memo.changes == changes and memo.result is not None:
        return memo.result, memo
    keep: frozenset[tuple[int, bytes]] = frozenset()
    if same:
        keep = memo.found

    def seen(gid: int, digest: bytes) -> bool:
        return (gid, bytes(digest)) in keep or present(gid, digest)

    res = store_lookup(geo, num_tokens, hashes, seen)
    token_len = geo.align_lookup_length(num_tokens)
    found = frozenset(
        (gid, bytes(hashes[u]))
        for gid, units in candidate_units(geo, len(hashes), max(token_len, 0)).items()
        for u in units if seen(gid, bytes(hashes[u])))
    return res, LookupMemo(num_tokens, removals, found, changes, res)


def tail_key_boundaries(geo: StoreGeometry, hashes: Sequence[bytes], hit: int,
                        pool: ExternalCachedBlockPool) -> tuple[TailKeyBoundary, ...]:
    """Per group, the boundary whose hash keys its last chunk: ``hit`` itself, else the first
    present later boundary inside the same chunk (an EAGLE proof key); AssertionError if none."""
    if hit <= 0:
        return ()
    h = geo.hash_block_size
    out = []
    idx = hit // h - 1
    for gid, bs in enumerate(geo.block_sizes):
        chunk = cdiv(hit, bs) - 1
        boundary = hit
        contains = pool.contains(gid, hashes[idx])
        if not geo.partial_hits:
            assert contains
        if not contains:
            end = min((chunk + 1) * bs // h, len(hashes))
            for u in range(idx + 1, end):
                if pool.contains(gid, hashes[u]):
                    boundary = (u + 1) * h
                    break
            else:
                raise AssertionError(f"No tail key found for cache group {gid} at {hit}")
        out.append(TailKeyBoundary(gid, boundary))
    return tuple(out)


def get_num_new_matched_tokens(geo: StoreGeometry, enable_lookup: bool, load_async: bool,
                   load_specs: dict[str, LoadSpec], rid: str, num_tokens: int,
                   num_computed: int, lookup: Callable[[], LookupResult],
                   defer: Callable[[int], bool] | None = None) -> tuple[int | None, bool]:
    """``get_num_new_matched_tokens`` (MS:210-265): sub-block prompts are looked up only with
    partial hits; a load is proposed only when the store beats ``num_computed``. EXTENSION
    rule 7 (``defer``, not vLLM 0.33): None (ask again next step) when the request extends
    an in-flight job's key past ``max(hit, num_computed)``."""
    if not enable_lookup:
        return 0, False
    if num_tokens < geo.alignment:
        return 0, False
    res = lookup()
    if defer is not None and defer(max(res.hit_length, num_computed)):
        return None, False
    need = max(0, res.hit_length - num_computed)
    if need <= 0:
        return 0, False
    load_specs[rid] = LoadSpec(vllm_cached_tokens=num_computed,
                               kvpool_cached_tokens=res.hit_length, can_load=False,
                               tail_key_boundaries=res.tail_key_boundaries)
    return need, load_async


@dataclass(frozen=True)
class Arbitration:
    local: int  # local computed tokens adopted
    external: int  # external tokens to load
    load_async: bool
    truncated: bool  # local blocks cut back to the block-aligned hit


def arbitrate(local_hit: int, lcm: int, ext: int, load_async: bool) -> Arbitration:
    """The scheduler's remote-vs-local rule (SC:1129-1190): the connector sees the block-aligned
    local hit; a remote hit must strictly beat a local sub-block tail to replace it."""
    partial_tail = local_hit % lcm
    aligned = local_hit - partial_tail
    if partial_tail and ext > partial_tail:
        return Arbitration(aligned, ext, load_async, True)
    if partial_tail:
        return Arbitration(local_hit, 0, False, False)
    return Arbitration(local_hit, ext, load_async, False)
