"""The store path with a sliding-window group: which window blocks the store writes and probes
(``MooncakeStoreCoordinator.store_mask`` / ``lookup_mask``), in the reference connector
(``reference.connector.masks``) and in ``impl``'s sending thread, against numbers worked out by
hand and against vLLM 0.33's own coordinator."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.lookup import candidate_units
from tailproof.reference.connector.masks import lookup_mask, store_mask

FA, SW, M = "full_attention", "sliding_window", "mamba_align"
# (groups as (kind, block, eagle), h, use_eagle); each window is block + 1 tokens.
WINDOW = ([(FA, 4, False), (SW, 4, False), (M, 16, False)], 2, False)  # lcm 16, need 1
WINDOW_EAGLE = ([(FA, 16, False), (SW, 16, True), (M, 64, False)], 8, True)  # lcm 64, need 2


def _config(geometry: tuple[list[tuple[str, int, bool]], int, bool]) -> SimpleNamespace:
    groups, h, eagle = geometry
    return SimpleNamespace(
        groups=[SimpleNamespace(kind=k, block_size=b, eagle=e,
                                sliding_window=b + 1 if k == SW else None)
                for k, b, e in groups],
        hash_block_size=h, num_blocks=64, enable_caching=True, use_eagle=eagle,
        max_model_len=8192, max_num_scheduled_tokens=8192, long_prefill_token_threshold=0)


def _geo(geometry: Any) -> StoreGeometry:
    return StoreGeometry.from_config(_config(geometry))


def test_store_mask_keeps_the_window_run_before_each_lcm_boundary() -> None:
    geo = _geo(WINDOW)
    fa, sw, mamba = store_mask(geo, 48, 0)
    assert fa is None  # every full-attention block
    assert sw == [False, False, False, True] * 3  # blocks 3, 7, 11: keys 16, 32, 48
    assert mamba == [False] * 3  # Mamba states only as exact hand-offs
    # From a saved offset of 20 tokens on, the mask starts at chunk cdiv(20, 4) = 5.
    assert store_mask(geo, 48, 20)[1] == [False, False, True, False, False, False, True]
    # An offset past the save end leaves nothing to write.
    assert store_mask(geo, 16, 20)[1] == []


def test_store_mask_shifts_the_run_by_the_eagle_peek_block() -> None:
    geo = _geo(WINDOW_EAGLE)
    assert geo.eagle_group_ids == frozenset({1})
    # A hit at 64 needs blocks 3 and 4 (the peek past the boundary), at 128 blocks 7 and 8.
    assert store_mask(geo, 128, 0)[1] == [False, False, False, True, True, False, False, True]


def test_lookup_probes_only_masked_window_chunks() -> None:
    geo = _geo(WINDOW)
    fa, sw, mamba = lookup_mask(geo, 48)
    assert fa is None and mamba is None  # dense retention: Mamba probes every block
    assert sw == [False, False, False, True] * 3
    units = candidate_units(geo, 24, 48)  # 24 hashes of 2 tokens
    assert units[1] == [7, 15, 23]  # the block-end hash units of window blocks 3, 7, 11
    assert units[0] == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]


def test_partial_hits_probe_every_unit() -> None:
    geo = _geo(([(FA, 4, False), (SW, 4, False), (M, 16, False)], 4, False))
    assert geo.partial_hits
    assert candidate_units(geo, 12, 44)[1] == list(range(11))


@pytest.mark.vllm
@pytest.mark.parametrize("geometry", [WINDOW, WINDOW_EAGLE], ids=["window", "eagle-window"])
def test_masks_match_vllm_coordinator(geometry: Any) -> None:
    """The reference masks equal ``MooncakeStoreCoordinator``'s over vLLM's real specs, for
    every lcm-aligned save end and every saved offset below it."""
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")
    from tailproof.conformance.format.trace import parse_trace
    from tailproof.conformance.harness.adapters.vllm_core import VllmCoreBackend
    from tailproof.conformance.tools.generate import geometry_config
    from tailproof.impl.config import StoreGeometry as ImplGeometry
    from tailproof.impl.connector import build_coordinator

    trace = parse_trace({"format": "tailproof-trace/1", "name": "masks",
                         "config": geometry_config(geometry, 64), "ops": []})
    core = VllmCoreBackend(trace.config)
    cfg = trace.config
    impl_geo = ImplGeometry(
        core_group_ids=tuple(range(len(cfg.groups))),
        block_sizes=tuple(g.block_size for g in cfg.groups),
        is_mamba=tuple(g.is_mamba for g in cfg.groups), hash_block_size=cfg.hash_block_size,
        scheduler_block_size=cfg.scheduler_block_size, partial_hits=core.partial_hits,
        use_eagle=cfg.use_eagle)
    coord = build_coordinator(impl_geo, core.kv_cache_config, 1)
    geo = StoreGeometry.from_config(cfg)
    lcm = cfg.scheduler_block_size
    for end in range(lcm, 4 * lcm + 1, lcm):
        assert tuple(coord.lookup_mask(end)) == lookup_mask(geo, end), end
        for start in range(0, end + 1, cfg.hash_block_size):
            assert tuple(coord.store_mask(end, start, num_prompt_tokens=end)) == \
                store_mask(geo, end, start), (end, start)
