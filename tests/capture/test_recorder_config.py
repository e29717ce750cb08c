"""The recorder's trace ``config`` carries a Mamba group's speculative blocks, so a captured
engine with speculative decoding replays with the table layout it ran with, and the engine's
Mamba retention interval, so a trace of sparse retention is refused rather than replayed
densely (where it diverges at the first decode step that fills a Mamba block)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")


def _scheduler(num_spec: int, retention: int | None = None) -> SimpleNamespace:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align", num_speculative_blocks=num_spec)
    kvc = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], fa),
                                         KVCacheGroupSpec(["m"], mamba)],
                        prefix_cache_retention_interval=retention)
    return SimpleNamespace(
        kv_cache_config=kvc, kv_cache_manager=SimpleNamespace(use_eagle=False),
        hash_block_size=4, cache_config=SimpleNamespace(enable_prefix_caching=True,
                                                        block_size=16),
        max_model_len=1024, max_num_scheduled_tokens=256,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))


@pytest.mark.parametrize("num_spec", [0, 2])
def test_config_records_speculative_blocks(num_spec: int) -> None:
    from tailproof.conformance.capture.recorder import config_from_scheduler
    from tailproof.conformance.format.trace import FORMAT_TAG, parse_trace

    cfg = config_from_scheduler(_scheduler(num_spec))
    assert cfg["groups"][1].get("num_speculative_blocks", 0) == num_spec
    assert "num_speculative_blocks" not in cfg["groups"][0]
    trace = parse_trace({"format": FORMAT_TAG, "name": "t", "config": cfg, "ops": []})
    assert trace.config.groups[1].num_speculative_blocks == num_spec


@pytest.mark.parametrize("retention", [None, 0, 32])
def test_config_records_sparse_retention_and_every_adapter_refuses_it(
        retention: int | None) -> None:
    from tailproof.conformance.capture.recorder import config_from_scheduler
    from tailproof.conformance.format.trace import FORMAT_TAG, parse_trace
    from tailproof.conformance.harness.adapters import (
        ADAPTERS,
        AdapterRefused,
        make_driver,
        refusal,
    )

    cfg = config_from_scheduler(_scheduler(0, retention))
    assert cfg.get("prefix_cache_retention_interval") == retention
    assert ("prefix_cache_retention_interval" in cfg) == (retention is not None)
    config = parse_trace({"format": FORMAT_TAG, "name": "t", "config": cfg, "ops": []}).config
    assert config.sparse_retention == (retention is not None)
    for name in ADAPTERS:
        why = refusal(name, config)
        if retention is None:
            assert why is None, (name, why)
        else:
            assert why is not None and f"prefix_cache_retention_interval={retention}" in why
    if retention is not None:
        with pytest.raises(AdapterRefused, match="sparse Mamba"):
            make_driver("reference", config)


@pytest.mark.parametrize(("value", "msg"), [
    (-1, "must be null or an int >= 0"), (True, "must be null or an int >= 0"),
    (24, "must be a multiple of the scheduler block size"),
])
def test_retention_interval_is_validated(value: object, msg: str) -> None:
    from tailproof.conformance.capture.recorder import config_from_scheduler
    from tailproof.conformance.format.trace import FORMAT_TAG, TraceError, parse_trace

    cfg = {**config_from_scheduler(_scheduler(0)), "prefix_cache_retention_interval": value}
    with pytest.raises(TraceError, match=f"config.prefix_cache_retention_interval: {msg}"):
        parse_trace({"format": FORMAT_TAG, "name": "t", "config": cfg, "ops": []})


def test_retention_interval_needs_a_sliding_window_or_mamba_group() -> None:
    from tailproof.conformance.format.trace import FORMAT_TAG, TraceError, parse_trace

    cfg = {"groups": [{"kind": "full_attention", "block_size": 16}], "hash_block_size": 16,
           "num_blocks": 8}
    dense = parse_trace({"format": FORMAT_TAG, "name": "t", "ops": [],
                         "config": {**cfg, "prefix_cache_retention_interval": 0}}).config
    assert not dense.sparse_retention  # vLLM: 0 has no effect without such a group
    with pytest.raises(TraceError, match="needs a sliding-window or Mamba group"):
        parse_trace({"format": FORMAT_TAG, "name": "t", "ops": [],
                     "config": {**cfg, "prefix_cache_retention_interval": 16}})
