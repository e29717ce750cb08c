"""vLLM #56971 side by side: vLLM 0.33's Mooncake store key ignores the KV-cache dtype, the
TailproofConnector key does not (its layout fingerprint, ``impl/fingerprint.py``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")
pytestmark = pytest.mark.vllm

from tailproof.conformance.tools.history.findings import keys_ignore_layout  # noqa: E402
from tailproof.impl.config import geometry_from_vllm  # noqa: E402
from tailproof.impl.fingerprint import fingerprint_from_vllm  # noqa: E402

H, NB = 4, 32


def _configs() -> tuple[Any, Any, Any]:
    from engine_sim import GROUPS, kv_cache_config, vllm_config

    vc = vllm_config({"store": "memory"}, h=H)
    fp8 = copy.copy(vc)
    cache = copy.copy(vc.cache_config)
    object.__setattr__(cache, "cache_dtype", "fp8")  # config dataclasses validate on set
    object.__setattr__(fp8, "cache_config", cache)
    return vc, fp8, kv_cache_config(NB, GROUPS, H)


def _vllm_prefix(vc: Any) -> str:
    """The key prefix ``MooncakeStoreWorker.__init__`` builds (``KeyMetadata`` from the model
    path's basename, the ranks, ``cache_prefix`` and the store namespace) for rank 0."""
    import importlib

    from tailproof.conformance.vllm_release import mooncake_layout_module

    layout = importlib.import_module(mooncake_layout_module())  # data.py on 0.33, layout.py
    KeyMetadata, PoolKey = layout.KeyMetadata, layout.PoolKey  # noqa: N806

    meta = KeyMetadata(model_name=vc.model_config.model.rstrip("/").split("/")[-1],
                       tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, cache_prefix="",
                       store_namespace="")
    return PoolKey.build_prefix(meta)


def test_56971_side_by_side() -> None:
    fp16, fp8, kvc = _configs()
    assert fp16.cache_config.cache_dtype != fp8.cache_config.cache_dtype
    # vLLM: nothing the key is built from depends on the KV-cache dtype -- one key for both.
    assert _vllm_prefix(fp16) == _vllm_prefix(fp8)
    assert keys_ignore_layout(), "vLLM's KeyMetadata gained a layout field: update #56971"
    # TailproofConnector: the fingerprint in every key changes with it (a load across fails
    # closed as a miss).
    a = fingerprint_from_vllm(fp16, kvc, geometry_from_vllm(fp16, kvc))
    b = fingerprint_from_vllm(fp8, kvc, geometry_from_vllm(fp8, kvc))
    assert a.digest != b.digest
