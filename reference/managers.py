"""Per-group block tables: full attention, sliding window and Mamba "align" (mirrors
``v1/core/single_type_kv_cache_manager.py``). One module (over 600 lines) because vLLM's is
one: a reader compares the two class by class.

Out of scope and therefore absent: MTP's extra retained window tokens, DCP/PCP, internal
prefill checkpoints, sparse retention (dense only), KV events, zeroing bookkeeping. Modelled:
speculative Mamba blocks (``MambaSpec.num_speculative_blocks``) and shared-prefix junctions (the
Mamba state kept at the junction, ``MambaManager._cache_partial_tail_block``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tailproof.reference.block_pool import Block, BlockPool
from tailproof.reference.hashing import BlockHash, Key
from tailproof.reference.request import Request
from tailproof.spec.arithmetic import cdiv, checkpoint_position, fine_grained

# (request id, group id, block, boundary tokens)
Offload = tuple[str, int, Block, int]


class FullAttentionManager:
    """``SingleTypeKVCacheManager`` + ``FullAttentionManager``: an append-only table per request."""

    kind = "full_attention"

    def __init__(
        self,
        block_size: int,
        pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        scheduler_block_size: int,
    ) -> None:
        self.block_size = block_size
        self.block_pool = pool
        self.kv_cache_group_id = group_id
        self.enable_caching = enable_caching
        # Lowered to h by the hybrid coordinator when partial hits are on.
        self.cache_hit_alignment_tokens = scheduler_block_size
        self.use_eagle = False
        self._null_block = pool.null_block
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Presence also marks the request as running for this manager.
        self.num_cached_block: dict[str, int] = {}
        # Pending CoW: table index whose shared block's valid prefix ends inside it.
        self._partial_hit_reqs: dict[str, tuple[int, Block]] = {}
        self._pending_cow_copies: list[tuple[Block, Block]] = []
        self._pending_boundary_state_offloads: list[Offload] = []

    # --- lookup ------------------------------------------------------------------------

    @staticmethod
    def find_longest_cache_hit(
        block_hashes: list[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        block_size: int,
        drop_eagle_block: bool,
        alignment: int,
    ) -> tuple[list[list[Block]], int]:
        """mirrors FullAttentionManager.find_longest_cache_hit: phase 1 full blocks, phase 2
        (fine-grained) the first non-full block's interior boundaries high to low, then the
        EAGLE drop of one unit and rounding to the alignment."""
        h = pool.hash_block_size
        fine = fine_grained(block_size, alignment)
        computed: list[list[Block]] = [[] for _ in group_ids]
        num_full_hashes = len(block_hashes) * h // block_size
        for i in range(min(max_length // block_size, num_full_hashes)):
            boundary = (i + 1) * block_size
            cached = pool.get_cached_block(block_hashes[boundary // h - 1], boundary, group_ids)
            if not cached:
                break
            for out, blk in zip(computed, cached, strict=True):
                out.append(blk)
        hit_length = len(computed[0]) * block_size
        if fine:
            # Fine-grained implies alignment == h (the raw hash list is probed).
            scale = block_size // alignment
            first_partial_idx = len(computed[0]) * scale
            max_partial_idx = min(
                first_partial_idx + scale - 1, max_length // alignment, len(block_hashes)
            )
            for fine_idx in range(max_partial_idx - 1, first_partial_idx - 1, -1):
                boundary = (fine_idx + 1) * alignment
                cached = pool.get_cached_block(block_hashes[fine_idx], boundary, group_ids)
                if not cached:
                    continue
                for out, blk in zip(computed, cached, strict=True):
                    out.append(blk)
                hit_length = boundary
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment, block_size)
        hit_length -= hit_length % alignment
        num_blocks = cdiv(hit_length, block_size)
        for out in computed:
            del out[num_blocks:]
        return computed, hit_length

    # --- admission ---------------------------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0  # full attention keeps every token

    def _has_partial_local_hit(
        self, new_computed_blocks: Sequence[Block], num_local_computed_tokens: int
    ) -> bool:
        # mirrors SingleTypeKVCacheManager._has_partial_local_hit
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """mirrors SingleTypeKVCacheManager.get_num_blocks_to_allocate (+1 for a CoW target)."""
        num_required = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            assert len(new_computed_blocks) == 0
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new = max(num_required - max(num_skipped_blocks, num_local_computed_blocks), 0)
        skip_new = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(
            1 for b in new_computed_blocks[skip_new:] if b.ref_cnt == 0 and not b.is_null
        )
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            num_new += 1
        return num_new + num_evictable

    # --- allocation --------------------------------------------------------------------

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Block],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """mirrors SingleTypeKVCacheManager.add_local_computed_blocks: touch the hit, pad skipped
        blocks with nulls, and record a partial local hit for the CoW."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert len(req_blocks) == 0
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not any(new_computed_blocks)
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> None:
        """mirrors SingleTypeKVCacheManager.allocate_external_computed_blocks."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(total)
        if num_skipped > 0:
            num_external_computed_tokens = min(total - num_skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        """mirrors SingleTypeKVCacheManager.allocate_new_blocks: the CoW target is popped first,
        then the blocks that extend the table."""
        cow_blocks: list[Block] = []
        if request_id in self._partial_hit_reqs:
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            cow = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source, cow)
            cow_blocks.append(cow)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return cow_blocks + new_blocks

    def _apply_cow(self, request_id: str, block_idx: int, source: Block, cow: Block) -> None:
        """mirrors SingleTypeKVCacheManager._apply_cow (first-allocation CoW): the table entry
        becomes the private ``cow``; both endpoints stay retained until the copy is released."""
        req_blocks = self.req_to_blocks[request_id]
        assert block_idx < len(req_blocks)
        assert req_blocks[block_idx] is source
        assert not source.is_null and source.ref_cnt > 0
        req_blocks[block_idx] = cow
        self._pending_cow_copies.append((source, cow))
        cow.ref_cnt += 1

    # --- caching -----------------------------------------------------------------------

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """mirrors SingleTypeKVCacheManager.cache_blocks (dense retention)."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks.setdefault(rid, []),
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[rid] = num_full

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """mirrors FullAttentionManager.cache_blocks: full blocks, then the prompt's final hash
        boundary as a partial entry when it ends inside a block."""
        self._cache_full_blocks(request, num_tokens)
        if self.block_size == self.block_pool.hash_block_size:
            return
        self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """mirrors FullAttentionManager._cache_partial_tail_block. Re-runs after promotion, so
        a filled block keeps the partial key as a secondary key."""
        h = self.block_pool.hash_block_size
        token_limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(token_limit // h, len(request.block_hashes)) * h
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(
            request, blocks[block_idx], boundary, self.kv_cache_group_id, self.block_size
        )

    # --- release -----------------------------------------------------------------------

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        """mirrors SingleTypeKVCacheManager.pop_blocks_for_free: the table minus leading nulls."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        i = 0
        while i < len(req_blocks) and req_blocks[i].is_null:
            i += 1
        return req_blocks[i:]

    def free(self, request_id: str) -> None:
        """mirrors SingleTypeKVCacheManager.free: reversed, so a chain's tail is evicted first."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """Full attention never skips tokens (``get_num_skipped_tokens`` is 0)."""
        return None

    def new_step_starts(self) -> None:
        return None

    def take_pending_cow_copies(self) -> list[tuple[Block, Block]]:
        out, self._pending_cow_copies = self._pending_cow_copies, []
        return out

    def take_pending_boundary_state_offloads(self) -> list[Offload]:
        out, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return out

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, Block, int] | None:
        return None


class SlidingWindowManager(FullAttentionManager):
    """``SlidingWindowManager``: tokens before the window are skipped, their blocks freed and
    replaced by the null block; a hit needs ``cdiv(window - 1, block_size)`` contiguous cached
    blocks (one more with EAGLE), found right to left; caching keeps only the blocks a hit at
    an aligned length can use (``reachable_block_mask``, dense retention)."""

    kind = "sliding_window"

    def __init__(
        self,
        block_size: int,
        pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        scheduler_block_size: int,
        sliding_window: int,
    ) -> None:
        super().__init__(block_size, pool, group_id, enable_caching, scheduler_block_size)
        self.sliding_window = sliding_window

    @staticmethod
    def contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        # mirrors SlidingWindowManager._contiguous_blocks_for_hit
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    @staticmethod
    def find_window_hit(
        block_hashes: list[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        block_size: int,
        drop_eagle_block: bool,
        alignment: int,
        window: int,
    ) -> tuple[list[list[Block]], int]:
        """mirrors SlidingWindowManager.find_longest_cache_hit: block-granular hashes, a right
        to left scan for enough contiguous cached blocks (the run's right edge aligned), the
        blocks before it null, then the EAGLE drop and re-alignment."""
        h = pool.hash_block_size
        need = SlidingWindowManager.contiguous_blocks_for_hit(window, block_size,
                                                              drop_eagle_block)
        max_num_blocks = max_length // block_size
        null = pool.null_block
        computed: list[list[Block]] = [[null] * max_num_blocks for _ in group_ids]
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            boundary = (i + 1) * block_size
            cached = pool.get_cached_block(block_hashes[boundary // h - 1], boundary, group_ids)
            if cached:
                if num_contiguous == 0 and block_size != alignment:
                    post_pop_blocks = i if drop_eagle_block else i + 1
                    if (post_pop_blocks * block_size) % alignment != 0:
                        continue
                for out, blk in zip(computed, cached, strict=True):
                    out[i] = blk
                num_contiguous += 1
                if num_contiguous >= need:
                    for out in computed:
                        del out[i + num_contiguous:]
                    match_found = True
                    break
            else:
                num_contiguous = 0
        if not match_found:
            for out in computed:
                del out[num_contiguous:]
            while block_size != alignment and len(computed[0]) * block_size % alignment != 0:
                for out in computed:
                    out.pop()
        if drop_eagle_block and computed[0]:
            for out in computed:
                out.pop()
            while block_size != alignment and len(computed[0]) * block_size % alignment != 0:
                for out in computed:
                    out.pop()
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """mirrors SlidingWindowManager.get_num_skipped_tokens (no extra retained tokens)."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @staticmethod
    def reachable_block_mask(start_block: int, end_block: int, alignment: int,
                             block_size: int, window: int,
                             use_eagle: bool) -> list[bool] | None:
        """mirrors SlidingWindowManager.reachable_block_mask with dense retention
        (``retention_interval`` None, no final segment): per aligned segment, the ``need``
        blocks whose run ends on its boundary (shifted one block by the EAGLE peek); None
        (every block) when the alignment is not a whole number of blocks or a segment is no
        longer than a hit's run. The Mooncake store's ``store_mask`` / ``lookup_mask`` use it
        too, with the lcm as the alignment."""
        if alignment % block_size != 0:
            return None
        need = SlidingWindowManager.contiguous_blocks_for_hit(window, block_size, use_eagle)
        shift = 1 if use_eagle else 0
        per_segment = alignment // block_size
        if need >= per_segment:
            return None
        return [i >= shift and (i - shift) % per_segment >= per_segment - need
                for i in range(start_block, end_block)]

    def _reachable_block_mask(self, start_block: int, end_block: int) -> list[bool] | None:
        return self.reachable_block_mask(start_block, end_block,
                                         self.cache_hit_alignment_tokens, self.block_size,
                                         self.sliding_window, self.use_eagle)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """mirrors SingleTypeKVCacheManager.cache_blocks (no partial tail entry for a window)."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[rid], num_cached, num_full, self.block_size,
            self.kv_cache_group_id, self._reachable_block_mask(num_cached, num_full),
        )
        self.num_cached_block[rid] = num_full

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """mirrors SingleTypeKVCacheManager.remove_skipped_blocks / _remove_blocks_in_range:
        the blocks before the window, freed back to front up to the first null."""
        num_skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped <= 0 or request_id not in self.req_to_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        last = min(num_skipped // self.block_size, len(blocks))
        freed: list[Block] = []
        for i in range(last - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)


class MambaAlignManager(FullAttentionManager):
    """``MambaManager`` with ``mamba_cache_mode == "align"``: entry i holds the state after
    (i+1)*B tokens or, at the live tail, the running state; interior entries become null.
    With S speculative blocks the table ends in S scratch blocks past the running state."""

    kind = "mamba_align"

    def __init__(
        self,
        block_size: int,
        pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        scheduler_block_size: int,
        num_speculative_blocks: int = 0,
    ) -> None:
        super().__init__(block_size, pool, group_id, enable_caching, scheduler_block_size)
        # MambaSpec.num_speculative_blocks (S): scratch states for drafts.
        self.num_speculative_blocks = num_speculative_blocks
        # True when the coordinator's use_eagle is set (checkpoints follow EAGLE's drop).
        self.drop_eagle_checkpoint_block = False
        # SingleTypeKVCacheManager.shared_prefix_checkpoint: also key the state at the
        # request's shared-prefix junction (Geometry.mamba_shared_prefix_checkpoint).
        self.shared_prefix_checkpoint = False
        # Keys registered or moved this step: a hit on one is deferred to the next step.
        self.cached_blocks_this_step: set[Key] = set()
        # Table index of the previous running-state block, freed next step.
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        # Requests with a real allocation (running CoW instead of first-allocation CoW).
        self._allocated_block_reqs: set[str] = set()
        # Producer markers: the request registered its own prompt-boundary sub-block entry.
        self._producer_partial_tail_reqs: dict[str, tuple[Block, int]] = {}

    @staticmethod
    def find_longest_cache_hit(
        block_hashes: list[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        block_size: int,
        drop_eagle_block: bool,
        alignment: int,
    ) -> tuple[list[list[Block]], int]:
        """mirrors MambaManager.find_longest_cache_hit: the rightmost cached state wins, padded
        with nulls before it; never applies the EAGLE drop."""
        h = pool.hash_block_size
        computed: list[list[Block]] = [[] for _ in group_ids]
        null = pool.null_block
        if fine_grained(block_size, alignment):
            scale = block_size // alignment
            for fine_idx in range(min(max_length // alignment, len(block_hashes)) - 1, -1, -1):
                boundary = (fine_idx + 1) * alignment
                cached = pool.get_cached_block(block_hashes[fine_idx], boundary, group_ids)
                if cached:
                    block_idx = fine_idx // scale
                    for out, blk in zip(computed, cached, strict=True):
                        out.extend([null] * block_idx)
                        out.append(blk)
                    return computed, boundary
            return computed, 0
        for i in range(max_length // block_size - 1, -1, -1):
            boundary = (i + 1) * block_size
            # Indexing past the hashes raises IndexError, as vLLM's block-size view does.
            cached = pool.get_cached_block(block_hashes[boundary // h - 1], boundary, group_ids)
            if cached:
                if block_size != alignment and boundary % alignment != 0:
                    continue
                for out, blk in zip(computed, cached, strict=True):
                    out.extend([null] * i)
                    out.append(blk)
                return computed, boundary
        return computed, 0

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # mirrors MambaManager.get_num_skipped_tokens: only the last state is needed.
        return num_computed_tokens - 1

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """mirrors MambaManager.get_num_blocks_to_allocate (align): same-step deferral, then at
        most one running block plus one CoW target, plus the S speculative blocks before the
        first allocation. Not clamped at 0 without a partial hit."""
        if (
            len(new_computed_blocks) > 0
            and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step
        ):
            return self.block_pool.num_gpu_blocks + 1
        num_spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        num_new = (
            num_required
            - len(new_computed_blocks)
            - len(self.req_to_blocks.setdefault(request_id, []))
        )
        has_partial_hit = (
            self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)
            or request_id in self._partial_hit_reqs
        )
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        # No internal checkpoint (num_prefill_checkpoint_blocks == 0).
        if num_new > 0:
            cap = 1 + int(has_partial_hit)
            if request_id not in self._allocated_block_reqs:
                cap += num_spec
            num_new = min(num_new, cap)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        """mirrors MambaManager.allocate_new_blocks (align). A pending partial hit takes the first
        new block as CoW target: first allocation -> ``_apply_cow``; running request -> the
        request keeps ``source`` and the keys move to the target (running CoW), which is handed
        off if the request is the producer of that tail. With S speculative blocks the table
        ends in S scratch blocks; those the new running position passes are moved to the end
        (``_relocate_speculative_block``) behind null entries instead of being reallocated."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        partial_hit = self._partial_hit_reqs.get(request_id)
        if num_required <= len(req_blocks) and partial_hit is None:
            # PR #51766: mark allocated even without a new block.
            self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(req_blocks)
        blocks_allocated = request_id in self._allocated_block_reqs
        if blocks_allocated:
            # Running: the running state sits just before the S scratch blocks.
            self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            # A new request's hit: the last entry holds the hit state.
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped_blocks = num_required - num_spec - 1
        if prev_len < num_skipped_blocks:
            req_blocks.extend([self._null_block] * (num_skipped_blocks - prev_len))
        if blocks_allocated:
            # Scratch blocks now behind the running position move to the end.
            for block_idx in range(prev_len - num_spec, min(prev_len, num_skipped_blocks)):
                self._relocate_speculative_block(req_blocks, block_idx)
        num_new = max(num_required - len(req_blocks), 0)
        if partial_hit is not None:
            num_new += 1
        assert num_new <= 1 + int(partial_hit is not None) + (0 if blocks_allocated else num_spec)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = req_blocks[prev_len:]
        if partial_hit is not None:
            block_idx, source = partial_hit
            cow = new_blocks[0]
            new_blocks = new_blocks[1:]
            if blocks_allocated:
                # Running CoW: worker tables are append-only, so the request stays on source.
                assert req_blocks[block_idx] is source
                self.block_pool.move_block_hashes(source, cow)
                self._pending_cow_copies.append((source, cow))
                source.ref_cnt += 1
                marker = self._producer_partial_tail_reqs.pop(request_id, None)
                if marker is not None:
                    marker_block, boundary = marker
                    assert marker_block is source
                    self._pending_boundary_state_offloads.append(
                        (request_id, self.kv_cache_group_id, cow, boundary)
                    )
                if cow.block_hash is not None:
                    self.cached_blocks_this_step.add(cow.block_hash)
            else:
                self._apply_cow(request_id, block_idx, source, cow)
                returned = [cow, *returned]
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        returned.extend(new_blocks)
        return returned

    def _relocate_speculative_block(self, req_blocks: list[Block], block_idx: int) -> None:
        """mirrors MambaManager._relocate_speculative_block: the scratch block (private,
        unkeyed) moves to the end of the table; its old entry becomes null."""
        block = req_blocks[block_idx]
        assert not block.is_null and block.ref_cnt == 1 and block.block_hash is None, (
            "speculative Mamba blocks must be exclusively owned and unhashed before relocation")
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """mirrors MambaManager.cache_blocks: full states, the prompt tail at ck(P), and a
        boundary-state hand-off for every newly keyed aligned state."""
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        self._cache_full_blocks(request, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        key = self._cache_partial_tail_block(request, num_tokens)
        if key is not None:
            self.cached_blocks_this_step.add(key)
        if after > before:
            blocks = self.req_to_blocks[rid]
            for idx in range(before, after):
                block = blocks[idx]
                if block.is_null or block.block_hash is None:
                    continue
                self.cached_blocks_this_step.add(block.block_hash)
                assert block.block_hash_num_tokens is not None
                self._pending_boundary_state_offloads.append(
                    (rid, self.kv_cache_group_id, block, block.block_hash_num_tokens)
                )

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> Key | None:
        """mirrors MambaManager._cache_partial_tail_block (regular path): only when this chunk
        ends exactly at ck(P) or, with ``shared_prefix_checkpoint``, at the request's junction
        inside the prompt chunk being computed; a sub-block entry leaves a pending CoW and a
        producer marker."""
        h = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % h != 0:
            return None
        at_junction = (
            self.shared_prefix_checkpoint
            and num_tokens == request.shared_prefix_boundary
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        )
        if not at_junction and num_tokens != checkpoint_position(
            request.num_prompt_tokens, h, self.drop_eagle_checkpoint_block
        ):
            return None
        block_idx = cdiv(num_tokens, self.block_size) - 1
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        if block_idx >= len(blocks):
            return None
        source = blocks[block_idx]
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(
            request, source, num_tokens, self.kv_cache_group_id, self.block_size
        )
        if key is not None and num_tokens % self.block_size:
            self._partial_hit_reqs[rid] = (block_idx, source)
            self.num_cached_block[rid] = block_idx
            self._producer_partial_tail_reqs[rid] = (source, num_tokens)
        return key

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """mirrors MambaManager._remove_blocks_in_range: null out retired states, tail first."""
        blocks = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if first_block >= last_block:
            return
        freed: list[Block] = []
        for i in range(last_block - 1, first_block - 1, -1):
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)
        self._num_retired_blocks[request_id] = last_block

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """mirrors MambaManager.remove_skipped_blocks: free states before the last processed
        token, then the previous running state once it lies behind."""
        num_skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped > 0:
            blocks = self.req_to_blocks.setdefault(request_id, [])
            num_skipped_blocks = min(num_skipped // self.block_size, len(blocks))
            self._remove_blocks_in_range(request_id, 0, num_skipped_blocks)
        last_idx = self.last_state_block_idx.get(request_id)
        if (
            last_idx is not None
            and last_idx < cdiv(processed_computed_tokens, self.block_size) - 1
        ):
            blocks = self.req_to_blocks.setdefault(request_id, [])
            if blocks[last_idx] is not self._null_block:
                self.block_pool.free_blocks([blocks[last_idx]])
                blocks[last_idx] = self._null_block

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, Block, int] | None:
        """mirrors MambaManager.finalize_partial_tail_offload: the marker is consumed either way;
        the table source is handed off only if nothing advanced past the boundary."""
        marker = self._producer_partial_tail_reqs.pop(request_id, None)
        if marker is None:
            return None
        source, boundary = marker
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, source, boundary

    def pop_blocks_for_free(self, request_id: str) -> list[Block]:
        """mirrors MambaManager.pop_blocks_for_free: also drops this request's undrained
        hand-offs (its blocks go back to the pool now)."""
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._producer_partial_tail_reqs.pop(request_id, None)
        if self._pending_boundary_state_offloads:
            self._pending_boundary_state_offloads = [
                e for e in self._pending_boundary_state_offloads if e[0] != request_id
            ]
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
