"""vLLM's real ``Scheduler`` (0.33 or 0.34) on CPU, for capturing traces without a GPU.

The scheduler, its ``KVCacheManager`` and (when configured) its KV connector are vLLM's own,
built from a ``VllmConfig`` the way the engine core builds them; the model is the weightless
hybrid stand-in (``tiny_hybrid``). Only the model runner is played here: each step's sampled
token is a deterministic function of the seed and the sequence so far, and the step's output
goes back through ``Scheduler.update_from_output`` as a ``ModelRunnerOutput``. With
``num_workers`` set, the scheduler runs a KV connector and the worker ranks run in this
process, each step's connector output included: ``TailproofConnector`` on its memory store
(``workers.WorkerRanks``), or vLLM's ``MooncakeStoreConnector`` on an embedded store
(``connector="mooncake"``, ``mooncake_ranks.MooncakeRanks``).
"""

from __future__ import annotations

import os
from typing import Any

from tailproof.conformance.vllm_release import model_runner_output
from tailproof.spec.arithmetic import lcm_all

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

DEFAULT_GROUPS = (("full_attention", 16), ("mamba", 16))


class CaptureEngine:
    """One engine: a real Scheduler plus a model runner that only samples tokens."""

    def __init__(self, *, groups: tuple[tuple[str, int], ...] = DEFAULT_GROUPS, h: int = 4,
                 num_blocks: int = 256, max_batched: int = 2048, max_num_seqs: int = 16,
                 long_prefill_token_threshold: int = 0, seed: int = 0,
                 max_model_len: int = 4096,
                 kv_transfer: dict[str, Any] | None = None,
                 num_workers: int | None = None, connector: str = "tailproof",
                 async_scheduling: bool | None = None) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tailproof.conformance.tools.capture_engine import tiny_hybrid  # deferred: torch

        init_none_hash(sha256)
        tiny_hybrid.register()
        if num_workers is not None and kv_transfer is None:
            kv_transfer = (mooncake_connector_config() if connector == "mooncake"
                           else tailproof_connector_config())
        self.h = h
        self.seed = seed
        sizes = [b for _, b in groups]
        model = ModelConfig(model=str(tiny_hybrid.MODEL_DIR), skip_tokenizer_init=True,
                            dtype="float32", max_model_len=max_model_len)
        cache = CacheConfig(block_size=min(sizes), enable_prefix_caching=True,
                            mamba_cache_mode="align", prefix_match_unit=h)
        cache.num_gpu_blocks = num_blocks
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=max_batched, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, is_encoder_decoder=False,
            long_prefill_token_threshold=long_prefill_token_threshold,
            # The trace format does not model the full-sequence admission gate
            # (allocate_slots(full_sequence_must_fit=True)); see docs/triage.md.
            scheduler_reserve_full_isl=False,
            # None: vLLM resolves it (True here); False runs a synchronous engine, where
            # 0.34's update_from_output also calls cache_blocks (the recorder checks it).
            async_scheduling=async_scheduling)
        self.vllm_config = VllmConfig(model_config=model, cache_config=cache,
                                      device_config=DeviceConfig("cpu"),
                                      scheduler_config=sched_cfg,
                                      kv_transfer_config=(KVTransferConfig(**kv_transfer)
                                                          if kv_transfer else None))
        self.kv_cache_config = kv_cache_config(num_blocks, groups, h)
        self.sched = Scheduler(self.vllm_config, self.kv_cache_config,
                               StructuredOutputManager(self.vllm_config),
                               block_size=lcm_all(sizes), hash_block_size=h, log_stats=False)
        self.ranks: Any = None
        if num_workers is not None:
            # deferred: the ranks pull in the connector adapters and the reference model (a
            # quarter of a second at every CLI start: the parser lists the capture workloads)
            from tailproof.conformance.tools.capture_engine.mooncake_ranks import MooncakeRanks
            from tailproof.conformance.tools.capture_engine.workers import WorkerRanks

            # Deferred frees are not modelled by the trace format (docs/triage.md).
            self.sched.defer_block_free = False
            if connector == "mooncake":
                self.ranks = MooncakeRanks(self.sched, self.kv_cache_config, num_workers)
            else:
                side = self.sched.connector.scheduler_side
                side.num_workers = side.lookup_client.world = num_workers
                self.ranks = WorkerRanks(self.vllm_config, self.kv_cache_config, groups,
                                         num_blocks, num_workers)
        self.requests: dict[str, Any] = {}
        self.steps = 0

    # -- requests -----------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int = 1) -> Any:
        """Submit a request (``Scheduler.add_request``), hashed at h like the engine does."""
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        req = Request(rid, list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.h, sha256))
        self.sched.add_request(req)
        self.requests[rid] = req
        return req

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.sched.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def output_of(self, rid: str) -> list[int]:
        return list(self.requests[rid].output_token_ids)

    def next_token(self, req: Any) -> int:
        """Deterministic 'sampling': a function of the seed and the sequence so far."""
        return 1000 + (self.seed * 7919 + sum(req.all_token_ids) * 31
                       + len(req.all_token_ids)) % 997

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> dict[str, int]:
        """One engine step: ``schedule``, sample, ``update_from_output``."""
        so = self.sched.schedule()
        if self.ranks is not None:
            mro, log = self.ranks.step(self.sched, so, self.next_token)
            if log.byte_errors:  # a load returned bytes of another prefix: never record it
                raise RuntimeError(f"step {self.steps}: {log.byte_errors[0]}")
            self.sched.update_from_output(so, mro)
            self.steps += 1
            return dict(so.num_scheduled_tokens)
        rids = list(so.num_scheduled_tokens)
        reqs = self.sched.requests
        sampled = []
        for rid in rids:
            req = reqs[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([self.next_token(req)] if done else [])
        mro = model_runner_output(rids, sampled_token_ids=sampled)
        self.sched.update_from_output(so, mro)
        self.steps += 1
        return dict(so.num_scheduled_tokens)

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left (and no store job holds a pin); returns the number
        of steps taken."""
        n = 0
        while self._busy() and n < max_steps:
            self.step()
            n += 1
        if self._busy():
            raise RuntimeError(f"engine still busy after {max_steps} steps")
        return n

    def _busy(self) -> bool:
        conn = self.sched.connector
        return self.sched.has_requests() or (conn is not None and conn.has_pending_push_work())

    def shutdown(self) -> None:
        if self.ranks is not None:
            self.ranks.shutdown()
        self.sched.shutdown()


def tailproof_connector_config() -> dict[str, Any]:
    """``--kv-transfer-config`` of ``TailproofConnector`` on the in-process memory store, with
    vLLM 0.33's pin rule (readable pins and the pin budget off), so that its captures replay
    on ``vllm-mooncake`` too (which refuses tailproof's pin rules)."""
    return {"kv_connector": "TailproofConnector",
            "kv_connector_module_path": "tailproof.impl.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": "memory", "readable_pins": False,
                                          "pin_budget_fraction": None},
            "kv_load_failure_policy": "recompute"}


def mooncake_connector_config() -> dict[str, Any]:
    """``--kv-transfer-config`` of vLLM 0.33's ``MooncakeStoreConnector`` (asynchronous loads,
    its default; the store itself is played in-process by ``mooncake_ranks``)."""
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"load_async": True},
            "kv_load_failure_policy": "recompute"}


def kv_cache_config(num_blocks: int, groups: tuple[tuple[str, int], ...], h: int,
                    layers_per_group: int = 1) -> Any:
    """The ``KVCacheConfig`` the engine would derive for these groups (tensors unused)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    specs = []
    for g, (kind, bs) in enumerate(groups):
        names = [f"g{g}.l{i}" for i in range(layers_per_group)]
        if kind == "mamba":
            spec: Any = MambaSpec(block_size=bs, shapes=((3,), (5,)),
                                  dtypes=(torch.float32, torch.float32),
                                  mamba_cache_mode="align")
        else:
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=4,
                                     dtype=torch.float32)
        specs.append(KVCacheGroupSpec(names, spec))
    lcm = lcm_all([bs for _, bs in groups])
    partial = any(k == "mamba" and bs > h for k, bs in groups)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                         hash_block_size=h, cache_hit_alignment_tokens=h if partial else lcm)
