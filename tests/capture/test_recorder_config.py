"""The recorder's trace ``config`` carries a Mamba group's speculative blocks, so a captured
engine with speculative decoding replays with the table layout it ran with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")


def _scheduler(num_spec: int) -> SimpleNamespace:
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
                                         KVCacheGroupSpec(["m"], mamba)])
    return SimpleNamespace(
        kv_cache_config=kvc, kv_cache_manager=SimpleNamespace(use_eagle=False),
        hash_block_size=4, cache_config=SimpleNamespace(enable_prefix_caching=True,
                                                        block_size=16),
        max_model_len=1024, max_num_scheduled_tokens=256,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))


@pytest.mark.parametrize("num_spec", [0, 2])
def test_config_records_speculative_blocks(num_spec: int) -> None:
    from tailproof.conformance.capture.recorder import config_from_scheduler
    from tailproof.conformance.trace import FORMAT_TAG, parse_trace

    cfg = config_from_scheduler(_scheduler(num_spec))
    assert cfg["groups"][1].get("num_speculative_blocks", 0) == num_spec
    assert "num_speculative_blocks" not in cfg["groups"][0]
    trace = parse_trace({"format": FORMAT_TAG, "name": "t", "config": cfg, "ops": []})
    assert trace.config.groups[1].num_speculative_blocks == num_spec
