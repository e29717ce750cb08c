"""Blocks, the free queue and the prefix-cache key maps (mirrors ``v1/core/block_pool.py`` and
``KVCacheBlock`` / ``FreeKVCacheBlockQueue`` of ``kv_cache_utils.py``).

The free queue discipline decides which block ids get handed out, so it is copied exactly:
initial order 1..N-1 (block 0 is the null block), ``popleft`` for allocation, and every
``free_blocks`` call prepends its newly-free unhashed blocks and appends its hashed ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tailproof.reference.hashing import BlockHash, Key, make_key
from tailproof.reference.request import Request


class Block:
    """``KVCacheBlock``: id, reference count and primary key (with the prefix length it covers;
    a partial entry ends inside the block)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_hash_num_tokens", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Key | None = None
        self.block_hash_num_tokens: int | None = None
        self.is_null = False

    def set_block_hash(self, key: Key, num_tokens: int | None) -> None:
        # mirrors KVCacheBlock.set_block_hash
        assert self.block_hash is None and self.block_hash_num_tokens is None
        self.block_hash = key
        self.block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self.block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, key={self.block_hash_num_tokens})"


class FreeBlockQueue:
    """``FreeKVCacheBlockQueue`` as an ordered dict (O(1) popleft, middle remove, both ends)."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._q: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._q)

    def popleft(self) -> Block:
        if not self._q:
            raise ValueError("No free blocks available")
        return self._q.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[Block]:
        assert len(self._q) >= n
        pop = self._q.popitem
        return [pop(last=False)[1] for _ in range(n)]

    def remove(self, block: Block) -> None:
        del self._q[block.block_id]

    def append_n(self, blocks: list[Block]) -> None:
        q = self._q
        for b in blocks:
            q[b.block_id] = b

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put ``blocks`` at the front, in list order."""
        q = self._q
        for b in reversed(blocks):
            q[b.block_id] = b
            q.move_to_end(b.block_id, last=False)

    def block_ids(self) -> list[int]:
        return list(self._q)


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        assert num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # key -> {block_id: block}; the first inserted block answers a lookup
        # (BlockHashToBlockMap.get_one_block).
        self.cached_block_hash_to_block: dict[Key, dict[int, Block]] = {}
        # Secondary keys of blocks that already have a primary key.
        self.cached_block_hashes_by_block: dict[int, set[Key]] = {}
        # mirrors BlockPool.__init__: block 0 is popped once and never returned.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # --- lookups -----------------------------------------------------------------------

    def get_cached_block(
        self, digest: BlockHash, boundary: int, group_ids: Sequence[int]
    ) -> list[Block] | None:
        """mirrors BlockPool.get_cached_block: one block per group, or None if any misses."""
        out = []
        cache = self.cached_block_hash_to_block
        for gid in group_ids:
            blocks = cache.get((gid, boundary, digest))
            if not blocks:
                return None
            out.append(next(iter(blocks.values())))
        return out

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    # --- key maintenance ---------------------------------------------------------------

    def _insert_block_hash(self, key: Key, block: Block, num_tokens: int | None) -> None:
        """mirrors BlockPool._insert_block_hash: primary if the block has none, else secondary."""
        if block.block_hash == key:
            return
        blocks = self.cached_block_hash_to_block.get(key)
        if blocks is not None and block.block_id in blocks:
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        if blocks is None:
            self.cached_block_hash_to_block[key] = {block.block_id: block}
        else:
            blocks[block.block_id] = block

    def _remove_cached_block_hashes(self, block: Block) -> list[Key]:
        """mirrors BlockPool._remove_cached_block_hashes: drop the primary and every secondary."""
        keys: list[Key] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return []
        removed = []
        cache = self.cached_block_hash_to_block
        for key in keys:
            blocks = cache.get(key)
            if blocks is not None and blocks.pop(block.block_id, None) is not None:
                removed.append(key)
                if not blocks:
                    del cache[key]
        block.reset_hash()
        return removed

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[Block],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """mirrors BlockPool.cache_full_blocks: null blocks and blocks the mask leaves out are
        skipped. A block that already has a shorter (partial) key is promoted: its old keys are
        removed first."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        h = self.hash_block_size
        for i, blk in enumerate(blocks[num_cached_blocks:num_full_blocks], num_cached_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            num_tokens = (i + 1) * block_size
            key = make_key(group_id, num_tokens, hashes, h)
            if blk.block_hash is not None:
                assert (
                    blk.block_hash_num_tokens is not None
                    and blk.block_hash_num_tokens < num_tokens
                )
                self._remove_cached_block_hashes(blk)
            self._insert_block_hash(key, blk, num_tokens)

    def cache_partial_block(
        self, request: Request, block: Block, num_tokens: int, group_id: int, block_size: int
    ) -> Key | None:
        """mirrors BlockPool.cache_partial_block (replace_existing_hashes=False): register a
        key at a hash boundary that may end inside ``block``."""
        if block.is_null:
            return None
        h = self.hash_block_size
        assert block_size % h == 0 and num_tokens % h == 0
        assert 0 < num_tokens // h <= len(request.block_hashes)
        key = make_key(group_id, num_tokens, request.block_hashes, h)
        blocks = self.cached_block_hash_to_block.get(key)
        already_cached = block.block_hash == key or (
            blocks is not None and block.block_id in blocks
        )
        if (
            not already_cached
            and block.block_hash is not None
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_tokens
        ):
            self._remove_cached_block_hashes(block)
        self._insert_block_hash(key, block, num_tokens)
        return key

    def move_block_hashes(self, src: Block, dst: Block) -> None:
        """mirrors BlockPool.move_block_hashes: re-point every key of ``src`` to ``dst``."""
        assert dst.block_hash is None
        assert dst.block_id not in self.cached_block_hashes_by_block
        num_tokens = src.block_hash_num_tokens
        for key in self._remove_cached_block_hashes(src):
            self._insert_block_hash(key, dst, num_tokens)

    # --- allocation and release --------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """mirrors BlockPool.get_new_blocks: pop from the front, evicting each block's keys."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        caching = self.enable_caching
        for block in ret:
            if caching:
                self._remove_cached_block_hashes(block)  # _maybe_evict_cached_block
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def touch(self, blocks: Iterable[Block]) -> None:
        """mirrors BlockPool.touch: a hit takes a reference (leaving the free queue at 0)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """mirrors BlockPool.free_blocks: per call, newly-free unhashed blocks are prepended (reused
        first), hashed ones appended (LRU), each in the given order. No underflow check, as in
        vLLM."""
        evict_last: list[Block] = []
        evict_first: list[Block] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """mirrors BlockPool.evict_blocks: strip keys, even of referenced blocks."""
        for block_id in block_ids:
            assert block_id < len(self.blocks)
            self._remove_cached_block_hashes(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """mirrors BlockPool.reset_prefix_cache: only when every non-null block is free."""
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = {}
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    # --- observation -------------------------------------------------------------------

    def keys(self) -> list[tuple[int, int, int]]:
        """Every key as (group, boundary_tokens, block_id)."""
        return [
            (key[0], key[1], bid)
            for key, blocks in self.cached_block_hash_to_block.items()
            for bid in blocks
        ]
