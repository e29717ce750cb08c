"""Load the lead's vLLM core adapter, completing its lazy import namespace if it is still a
stub (it needs every vLLM name the adapter uses). Imported only by ``@pytest.mark.vllm`` tests."""

from __future__ import annotations

from types import SimpleNamespace

NEEDED = ("MambaSpec", "FullAttentionSpec", "KVCacheGroupSpec", "KVCacheConfig",
          "KVCacheManager", "Request", "RequestStatus", "SamplingParams", "Scheduler",
          "get_request_block_hasher", "sha256", "torch")


def _complete_vllm() -> SimpleNamespace:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    return SimpleNamespace(
        torch=torch, SamplingParams=SamplingParams, sha256=sha256, KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher, Scheduler=Scheduler,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, MambaSpec=MambaSpec, Request=Request,
        RequestStatus=RequestStatus)


def vllm_backend_class():
    from tailproof.conformance.adapters import vllm_core

    ns = vllm_core._vllm()
    if not all(hasattr(ns, n) for n in NEEDED):
        vllm_core._vllm = _complete_vllm
    return vllm_core.VllmCoreBackend
