"""The two-group (FA + Mamba, block 16, h 4) geometry the worker-side tests share."""

from __future__ import annotations

from tailproof.conformance.harness.adapters.runner_sim import GroupShape
from tailproof.impl.config import StoreGeometry

H, BS, NB = 4, 16, 32
GEO = StoreGeometry(core_group_ids=(0, 1), block_sizes=(BS, BS), is_mamba=(False, True),
                    hash_block_size=H, scheduler_block_size=BS, partial_hits=True, use_eagle=False,
                    num_blocks=NB)
SHAPES = [GroupShape("full_attention", BS, layers=2), GroupShape("mamba", BS, layers=2)]
TOKENS = list(range(100, 160))
HASHES = [bytes([i]) * 8 for i in range(len(TOKENS) // H)]  # stand-ins for block hashes
