"""Store-side shared-prefix junctions: which prompts share a prefix with an earlier one.

vLLM 0.33 detects a junction only in the local device cache, and only where full attention
keyed a block (docs/junctions.md, rule 1): with attention blocks of 1,024 a system prompt that
ends off that grid is never seen as shared. The connector sees every admitted prompt's chained
h-block hashes, so it can tell exactly how far a new prompt agrees with any earlier one: the
hash of block k names the whole prefix ``(k + 1) * h``, so one set probe per block, from the
prompt's end down, finds the longest shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class JunctionIndex:
    """The chained block hashes of recently admitted prompts, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("junction index capacity must be >= 1")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def known_prefix_blocks(self, block_hashes: Sequence[bytes], limit: int) -> int:
        """How many leading blocks of ``block_hashes`` (at most ``limit``) some earlier prompt
        also had: the largest k with ``block_hashes[k - 1]`` indexed (0: none). Scanned from
        the top: one set probe per block, exact even when eviction left holes in a chain."""
        for k in range(min(limit, len(block_hashes)), 0, -1):
            if block_hashes[k - 1] in self._hashes:
                return k
        return 0

    def add(self, block_hashes: Sequence[bytes], num_blocks: int) -> None:
        """Index the first ``num_blocks`` hashes of a prompt (refreshing their recency)."""
        hashes = self._hashes
        # Reversed: a prompt's first blocks (the part most often shared) stay the most recent.
        for bh in reversed(block_hashes[:num_blocks]):
            if bh in hashes:
                hashes.move_to_end(bh)
            else:
                hashes[bh] = None
        while len(hashes) > self.capacity:
            hashes.popitem(last=False)
