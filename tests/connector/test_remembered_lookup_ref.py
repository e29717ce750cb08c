"""The reference's remembered-lookup rule (``reference.connector.lookup.remembered_lookup``):
with removals reported it answers what a fresh ``store_lookup`` answers; with removals
unreported a remembered key the store lost still counts (its load then fails closed)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.lookup import (
    LookupMemo,
    remembered_lookup,
    store_lookup,
)

FA, M = "full_attention", "mamba_align"


def _geo(h: int = 4) -> StoreGeometry:
    groups = [SimpleNamespace(kind=FA, block_size=16, eagle=False),
              SimpleNamespace(kind=M, block_size=16, eagle=False)]
    return StoreGeometry.from_config(SimpleNamespace(
        groups=groups, hash_block_size=h, num_blocks=64, enable_caching=True, use_eagle=False,
        max_model_len=8192, max_num_scheduled_tokens=8192, long_prefill_token_threshold=0))


@pytest.mark.parametrize("seed", range(8))
def test_reported_removals_give_the_fresh_answer(seed: int) -> None:
    rng = random.Random(seed)
    geo = _geo()
    hashes = [rng.randbytes(8) for _ in range(12)]
    keys: set[tuple[int, bytes]] = set()
    removals, memo = 0, None
    for _ in range(30):
        g, hh = rng.randrange(2), rng.choice(hashes)
        if rng.random() < 0.6:
            keys.add((g, hh))
        elif (g, hh) in keys:
            keys.discard((g, hh))
            removals += 1

        def present(gid: int, d: bytes) -> bool:
            return (gid, bytes(d)) in keys

        try:
            want = store_lookup(geo, 47, hashes, present)
        except AssertionError:
            memo = None
            continue
        got, memo = remembered_lookup(geo, 47, hashes, present, removals, memo)
        assert got == want


def test_unreported_removal_keeps_the_remembered_hit() -> None:
    geo = _geo()
    hashes = [bytes([i]) * 8 for i in range(12)]
    keys = {(g, hashes[u]) for u in range(8) for g in (0, 1)}

    def present(gid: int, d: bytes) -> bool:
        return (gid, bytes(d)) in keys

    first, memo = remembered_lookup(geo, 47, hashes, present, None, None)
    assert first.hit_length == 32
    keys.discard((0, hashes[3]))  # evicted, unreported (Mooncake)
    assert store_lookup(geo, 47, hashes, present).hit_length == 12
    stale, _ = remembered_lookup(geo, 47, hashes, present, None, memo)
    assert stale.hit_length == 32  # remembered: the load of it fails closed
    seen, _ = remembered_lookup(geo, 47, hashes, present, 1,
                                LookupMemo(memo.num_tokens, 0, memo.found))
    assert seen.hit_length == 12  # a memo taken at removal count 0 is dropped at 1
