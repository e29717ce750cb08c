"""Which chunks of each group the store writes and probes (mirrors
``MooncakeStoreCoordinator.store_mask`` / ``lookup_mask`` / ``_reachable_masks``, MCO:278-382).

A chunk is one block of a group. The store keeps exactly the blocks the local prefix cache
would (``SingleTypeKVCacheManager.reachable_block_mask`` with the lcm as the alignment): every
full-attention block (None, the all-True sentinel), and for a sliding window only the run of
blocks that a hit at some lcm boundary needs. Mamba groups are never written positionally
(their states travel only as exact hand-offs), so ``store_mask`` gives them all-False; for
lookups a Mamba group is dense. Retention is dense here (``retention_interval`` None), so the
replay boundaries ``store_mask`` computes from ``num_prompt_tokens`` change nothing.
"""

from __future__ import annotations

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.geometry import MAMBA_ALIGN, SLIDING_WINDOW
from tailproof.reference.managers import SlidingWindowManager
from tailproof.spec.arithmetic import cdiv

Mask = list[bool] | None  # None: every chunk


def _reachable_masks(geo: StoreGeometry, aligned_token_len: int, start_token: int,
                     exclude_mamba: bool) -> tuple[Mask, ...]:
    """Per group, the mask of chunks ``cdiv(start_token, bs)`` .. ``aligned_token_len // bs``."""
    assert aligned_token_len % geo.alignment == 0, (aligned_token_len, geo.alignment)
    masks: list[Mask] = []
    for gid, (kind, bs) in enumerate(zip(geo.kinds, geo.block_sizes, strict=True)):
        end_chunk = aligned_token_len // bs
        start_chunk = min(end_chunk, max(0, cdiv(start_token, bs)))
        if kind == MAMBA_ALIGN and exclude_mamba:
            masks.append([False] * (end_chunk - start_chunk))
        elif kind == SLIDING_WINDOW:
            window = geo.windows[gid]
            assert window is not None
            masks.append(SlidingWindowManager.reachable_block_mask(
                start_chunk, end_chunk, geo.scheduler_block_size, bs, window,
                gid in geo.eagle_group_ids))
        else:  # full attention; Mamba with dense retention
            masks.append(None)
    return tuple(masks)


def store_mask(geo: StoreGeometry, aligned_token_len: int, start_token: int) -> tuple[Mask, ...]:
    """``store_mask``: per group, which chunks after ``start_token`` the normal save writes
    (the i-th entry is chunk ``cdiv(start_token, bs) + i``)."""
    return _reachable_masks(geo, aligned_token_len, start_token, exclude_mamba=True)


def lookup_mask(geo: StoreGeometry, aligned_token_len: int) -> tuple[Mask, ...]:
    """``lookup_mask``: per group, which chunks a lookup probes as hit boundaries."""
    return _reachable_masks(geo, aligned_token_len, 0, exclude_mamba=False)
