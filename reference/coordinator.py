"""Coordination across groups: the joint hybrid hit and per-group fan-out (mirrors
``v1/core/kv_cache_coordinator.py``: ``KVCacheCoordinatorNoPrefixCache``,
``UnitaryKVCacheCoordinator``, ``HybridKVCacheCoordinator``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tailproof.reference.block_pool import Block, BlockPool
from tailproof.reference.geometry import FULL_ATTENTION, MAMBA_ALIGN, SLIDING_WINDOW, Geometry
from tailproof.reference.hashing import BlockHash
from tailproof.reference.managers import (
    FullAttentionManager,
    MambaAlignManager,
    SlidingWindowManager,
)
from tailproof.reference.request import Request
from tailproof.spec.arithmetic import cdiv, eagle_proof_margin, round_down

Manager = FullAttentionManager  # the other managers are subclasses


def find_group_hit(
    kind: str, block_hashes: list[BlockHash], max_length: int, group_ids: Sequence[int],
    pool: BlockPool, block_size: int, drop: bool, alignment: int, window: int | None,
) -> tuple[list[list[Block]], int]:
    """The ``find_longest_cache_hit`` of the manager class of ``kind``."""
    if kind == SLIDING_WINDOW:
        assert window is not None
        return SlidingWindowManager.find_window_hit(
            block_hashes, max_length, group_ids, pool, block_size, drop, alignment, window)
    cls = MambaAlignManager if kind == MAMBA_ALIGN else FullAttentionManager
    return cls.find_longest_cache_hit(
        block_hashes, max_length, group_ids, pool, block_size, drop, alignment)


class Coordinator:
    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.block_pool = BlockPool(geo.num_blocks, geo.enable_caching, geo.hash_block_size)
        managers: list[Manager] = []
        for gid, g in enumerate(geo.groups):
            m: Manager
            if g.kind == SLIDING_WINDOW:
                assert g.sliding_window is not None
                m = SlidingWindowManager(g.block_size, self.block_pool, gid, geo.enable_caching,
                                         geo.scheduler_block_size, g.sliding_window)
            elif g.kind == MAMBA_ALIGN:
                m = MambaAlignManager(g.block_size, self.block_pool, gid, geo.enable_caching,
                                      geo.scheduler_block_size, g.num_speculative_blocks)
            else:
                m = FullAttentionManager(g.block_size, self.block_pool, gid, geo.enable_caching,
                                         geo.scheduler_block_size)
            m.use_eagle = geo.manager_use_eagle[gid]
            if geo.coordinator_kind == "hybrid":
                m.cache_hit_alignment_tokens = geo.alignment
            if isinstance(m, MambaAlignManager):
                # KVCacheCoordinator.__init__: Mamba checkpoints follow EAGLE's replay boundary.
                m.drop_eagle_checkpoint_block = geo.use_eagle
                # KVCacheManager.__init__ narrows the engine flag and sets it per manager.
                m.shared_prefix_checkpoint = geo.manager_shared_prefix_checkpoint
            managers.append(m)
        self.managers: tuple[Manager, ...] = tuple(managers)

    # --- lookup ------------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[list[list[Block]], int, int]:
        """(blocks per group, hit, uncached shared prefix); the last is 0 unless hybrid."""
        kind = self.geo.coordinator_kind
        if kind == "none":
            return [[] for _ in self.managers], 0, 0
        if kind == "unitary":
            # mirrors UnitaryKVCacheCoordinator.find_longest_cache_hit (alignment = block size).
            m = self.managers[0]
            g = self.geo.groups[0]
            blocks, hit = find_group_hit(
                g.kind, block_hashes, max_cache_hit_length, [0], self.block_pool, m.block_size,
                0 in self.geo.drop_eagle_group_ids, m.block_size, g.sliding_window,
            )
            return blocks, hit, 0
        return self._find_hybrid(block_hashes, max_cache_hit_length)

    def _find_hybrid(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[list[list[Block]], int, int]:
        """mirrors HybridKVCacheCoordinator.find_longest_cache_hit: a fixed point over the spec
        groups (full attention first), EAGLE margins for non-Mamba groups, then every
        full-attention group clipped to ``cdiv(hit, block_size)`` blocks. Also returns
        ``num_uncached_common_prefix_tokens``: how far the longest single-group hit of any
        pass runs past the reconciled hit (a prefix that Mamba has not cached yet)."""
        geo = self.geo
        h = geo.hash_block_size
        alignment = geo.alignment
        groups = geo.attention_groups
        hit_length = max_cache_hit_length
        by_group: list[list[Block] | None] = [None] * len(self.managers)
        len_by_group = [0] * len(self.managers)
        is_simple_hybrid = len(groups) == 2 and groups[0].kind == FULL_ATTENTION
        eagle_verified: set[int] = set()
        longest_hit_length = 0
        while True:
            curr = hit_length
            for idx, sg in enumerate(groups):
                first = sg.group_ids[0]
                if sg.kind == FULL_ATTENTION and by_group[first] is not None:
                    # Full attention is downward closed: trim, never re-probe.
                    curr = min(curr, len_by_group[first])
                    continue
                drop = sg.use_eagle and idx not in eagle_verified
                max_length = curr
                if drop and sg.kind != MAMBA_ALIGN:
                    # The EAGLE proof margin; Mamba never gets it (its finder never drops).
                    # A sliding window has no fine-grained lookup: its margin is one block.
                    margin = eagle_proof_margin(
                        sg.block_size, h, geo.partial_hits and sg.kind == FULL_ATTENTION)
                    max_length = min(curr + margin, len(block_hashes) * h)
                blocks, new_len = find_group_hit(
                    sg.kind, block_hashes, max_length, sg.group_ids, self.block_pool,
                    sg.block_size, drop, alignment, sg.sliding_window,
                )
                if drop:
                    eagle_verified.add(idx)
                elif new_len < curr:
                    eagle_verified.clear()
                curr = new_len
                for gid, blks in zip(sg.group_ids, blocks, strict=True):
                    by_group[gid] = blks
                    len_by_group[gid] = new_len
                longest_hit_length = max(longest_hit_length, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if is_simple_hybrid:
                break
        for sg in groups:
            if sg.kind != FULL_ATTENTION:
                continue
            num_blocks = cdiv(hit_length, sg.block_size)
            for gid in sg.group_ids:
                blks = by_group[gid]
                if blks is not None:
                    del blks[num_blocks:]
        blocks_out = [b if b is not None else [] for b in by_group]
        return blocks_out, hit_length, longest_hit_length - hit_length

    # --- admission and allocation ------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[Block]],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """mirrors KVCacheCoordinator.get_num_blocks_to_allocate: the sum over groups."""
        return sum(
            m.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                num_local_computed_tokens, num_tokens_main_model,
            )
            for i, m in enumerate(self.managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[Block]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """mirrors KVCacheCoordinator.allocate_new_computed_blocks: a no-op for a running
        request; else touch every group's hit first, then allocate external blocks (#33775)."""
        if any(request_id in m.num_cached_block for m in self.managers):
            assert all(len(b) == 0 for b in new_computed_blocks)
            return
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(
                request_id, new_computed_blocks[i], num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for m in self.managers:
                m.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens
                )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[list[Block]]:
        """mirrors KVCacheCoordinator.allocate_new_blocks: groups in order."""
        return [
            m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for m in self.managers
        ]

    # --- caching -----------------------------------------------------------------------

    def get_num_cacheable_tokens(self, num_computed_tokens: int, group_id: int) -> int:
        """mirrors ``get_num_cacheable_tokens`` (Hybrid override; base elsewhere). No MTP
        re-prefill tail (num_prefill_lookahead == 0)."""
        if self.geo.coordinator_kind != "hybrid":
            return max(0, num_computed_tokens)
        cached = self._align_cacheable(num_computed_tokens)
        m = self.managers[group_id]
        if m.use_eagle and cached > 0:
            finalized = max(0, num_computed_tokens)
            return min(finalized, self._align_cacheable(finalized) + m.block_size)
        return cached

    def _align_cacheable(self, num_tokens: int) -> int:
        # mirrors HybridKVCacheCoordinator._align_cacheable
        if self.geo.partial_hits:
            return num_tokens
        return round_down(num_tokens, self.geo.scheduler_block_size)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """mirrors KVCacheCoordinator.cache_blocks (dense retention: replay boundaries unused)."""
        for gid, m in enumerate(self.managers):
            if not m.enable_caching:
                continue
            m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, gid))

    # --- release and per-step ----------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, processed_computed_tokens)

    def free(self, request_id: str) -> None:
        """mirrors KVCacheCoordinator.free: each group frees its table reversed, groups in order."""
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> list[list[Block]]:
        return [list(m.req_to_blocks.get(request_id) or []) for m in self.managers]

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
