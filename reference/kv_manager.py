"""The scheduler's view of the KV cache (mirrors ``v1/core/kv_cache_manager.KVCacheManager``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tailproof.reference.block_pool import Block
from tailproof.reference.coordinator import Coordinator
from tailproof.reference.geometry import MAMBA_ALIGN, Geometry
from tailproof.reference.request import Request
from tailproof.spec.arithmetic import cdiv
from tailproof.spec.arithmetic import max_cache_hit_length as max_cache_hit_length_of

Blocks = list[list[Block]]  # per group


class KVCacheManager:
    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.enable_caching = geo.enable_caching
        self.max_model_len = geo.max_model_len
        self.coordinator = Coordinator(geo)
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(geo.groups)

    def empty_blocks(self) -> Blocks:
        return [[] for _ in range(self.num_groups)]

    # --- lookup ------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[Blocks, int, int]:
        """mirrors KVCacheManager.get_computed_blocks: no state change; the last token is always
        recomputed unless a bound is given (0.33), or always (0.34 clamps an explicit bound with
        ``Request.get_max_cache_hit_length``: ``Release.clamp_lookup_bound``). The third value
        is ``shared_prefix_boundary``: the hit plus the prefix only attention has cached (the
        junction), 0 when there is none."""
        if not self.enable_caching:
            return self.empty_blocks(), 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        else:
            max_cache_hit_length = max_cache_hit_length_of(
                request.num_tokens, max_cache_hit_length, self.geo.release.clamp_lookup_bound)
        blocks, hit, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        return blocks, hit, hit + num_uncached if num_uncached else 0

    def truncate_computed_blocks(self, blocks: Sequence[Sequence[Block]], n: int) -> Blocks:
        """mirrors KVCacheManager.truncate_computed_blocks: pure slicing at an aligned endpoint;
        a Mamba group may be shorter (an external state replaces it)."""
        out: Blocks = []
        for group_blocks, m in zip(blocks, self.coordinator.managers, strict=True):
            assert n % m.block_size == 0
            num = n // m.block_size
            if m.kind == MAMBA_ALIGN:
                num = min(num, len(group_blocks))
            else:
                assert num <= len(group_blocks)
            out.append(list(group_blocks[:num]))
        return out

    # --- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[Sequence[Block]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> Blocks | None:
        """mirrors KVCacheManager.allocate_slots (no watermark, admission gate or encoder
        tokens): remove skipped blocks, admit within the free blocks less ``reserved_blocks``
        (what the scheduler keeps for in-flight prefills while it admits an asynchronous
        load), adopt the hit, allocate, cache."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and (
            num_new_computed_tokens == 0
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        # create_kv_cache_blocks: an all-empty hit is the shared empty value (not adopted).
        has_hit_blocks = new_computed_blocks is not None and any(new_computed_blocks)
        hit_blocks: Sequence[Sequence[Block]] = (
            new_computed_blocks if new_computed_blocks is not None and has_hit_blocks
            else self.empty_blocks()
        )
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(
            num_local_computed + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        coord = self.coordinator
        # Frees out-of-window blocks even if the allocation below fails.
        coord.remove_skipped_blocks(
            request.request_id, max(0, total_computed - request.num_in_flight_tokens)
        )
        need = coord.get_num_blocks_to_allocate(
            request.request_id,
            num_tokens_need_slot,
            hit_blocks,
            num_local_computed + num_external_computed_tokens,
            num_local_computed,
            num_tokens_main_model,
        )
        if need > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if has_hit_blocks or num_external_computed_tokens > 0:
            coord.allocate_new_computed_blocks(
                request.request_id, hit_blocks, num_local_computed, num_external_computed_tokens
            )
        new_blocks = coord.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, num_tokens_main_model
        )
        if delay_cache_blocks:
            return new_blocks
        coord.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """mirrors KVCacheManager.cache_blocks (a delayed cache, once an async load landed)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    # --- hand-offs ---------------------------------------------------------------------

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[Block]]:
        """mirrors take_kv_cache_block_copies: copies and retained [src, dst, src, dst, ...];
        refcounts unchanged (the caller releases the retained list once)."""
        pairs: list[tuple[Block, Block]] = []
        for m in self.coordinator.managers:
            pairs.extend(m.take_pending_cow_copies())
        copies = [(s.block_id, d.block_id) for s, d in pairs]
        retained = [b for pair in pairs for b in pair]
        return copies, retained

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """mirrors take_boundary_state_offloads: {rid: [(group, block, boundary)]} in manager
        order then append order. No refcount change."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.coordinator.managers:
            for rid, gid, block, boundary in m.take_pending_boundary_state_offloads():
                out.setdefault(rid, []).append((gid, block.block_id, boundary))
        return out

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """mirrors finalize_partial_tail_offloads: consumes every producer marker."""
        out: list[tuple[int, int, int]] = []
        for m in self.coordinator.managers:
            res = m.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens
            )
            if res is not None:
                gid, block, boundary = res
                out.append((gid, block.block_id, boundary))
        return out

    # --- release -----------------------------------------------------------------------

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        self.block_pool.free_blocks(blocks)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.coordinator.reset_prefix_cache()

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    # --- views -------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> Blocks:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in g] for g in self.coordinator.get_blocks(request_id)]

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> list[list[int]]:
        """``KVCacheManager.get_block_ids_for_computed_tokens`` (KM:740-758): attention groups
        clipped to the blocks covering the computed tokens; Mamba groups whole."""
        return [ids if g.kind == MAMBA_ALIGN else ids[:cdiv(num_computed_tokens, g.block_size)]
                for g, ids in zip(self.geo.groups, self.get_block_ids(request_id), strict=True)]
