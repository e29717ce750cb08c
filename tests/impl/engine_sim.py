"""vLLM 0.33's real ``Scheduler`` with ``TailproofConnector``, on CPU, model runner by hand.

The scheduler builds its connector from ``--kv-transfer-config`` exactly as ``vllm serve``
does (``KVConnectorFactory`` + ``kv_connector_module_path``); the calling order (lookups,
allocations, boundary hand-offs, finish hooks, connector output) is therefore vLLM's own. The
GPU worker's side of each step is played by ``conformance.capture.workers.WorkerRanks`` (the
same ranks ``tailproof capture --connector tailproof`` runs), which checks every load byte for
byte.

Loads and store jobs run on the connector's background threads. ``settle=True`` (the default)
waits for them at the end of each worker step, so a test sees the same steps every run;
``settle=False`` lets them run free (the stress tests), and :meth:`Engine.run` then only waits
when a step had nothing to schedule.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tailproof.conformance.tools.capture_engine import engine as capture_engine  # noqa: E402
from tailproof.conformance.tools.capture_engine import tiny_hybrid  # noqa: E402
from tailproof.conformance.tools.capture_engine.workers import StepLog, WorkerRanks  # noqa: E402

__all__ = ["GROUPS", "Engine", "StepLog", "cache_block_size", "kv_cache_config", "vllm_config"]

GROUPS = (("full_attention", 16), ("mamba", 16))


_BASE_CONFIG: dict[int, Any] = {}  # ModelConfig per max_model_len


def vllm_config(extra: dict[str, Any], kv_role: str = "kv_both", h: int = 4,
                block_size: int = 16, max_batched: int = 2048,
                failure_policy: str = "recompute", max_model_len: int = 4096,
                connector: str = "TailproofConnector") -> Any:
    """A CPU ``VllmConfig`` for the tiny hybrid model with the Tailproof connector (or another
    connector vLLM registers by name, e.g. ``MooncakeStoreConnector``, with ``extra`` as its
    ``kv_connector_extra_config``)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    tiny_hybrid.register()
    if max_model_len not in _BASE_CONFIG:
        _BASE_CONFIG[max_model_len] = ModelConfig(
            model=str(tiny_hybrid.MODEL_DIR), skip_tokenizer_init=True, dtype="float32",
            max_model_len=max_model_len)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                     mamba_cache_mode="align", prefix_match_unit=h)
    module = ({"kv_connector_module_path": "tailproof.impl.connector"}
              if connector == "TailproofConnector" else {})
    kt = KVTransferConfig(kv_connector=connector, kv_role=kv_role,
                          kv_connector_extra_config=dict(extra),
                          kv_load_failure_policy=failure_policy, **module)
    sc = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=16,
                         max_model_len=max_model_len, is_encoder_decoder=False)
    return VllmConfig(model_config=_BASE_CONFIG[max_model_len], cache_config=cc,
                      device_config=DeviceConfig("cpu"), kv_transfer_config=kt,
                      scheduler_config=sc)


def cache_block_size(groups: tuple[tuple[str, int], ...]) -> int:
    """``CacheConfig.block_size`` vLLM 0.33 runs these groups with: the Mamba block when there
    is a Mamba group (``MambaModelConfig.verify_and_update_config`` sets ``mamba_block_size``
    from it, and ``Scheduler._mamba_block_aligned_split`` aligns chunks to it), else the
    smallest block. With 16-token attention blocks under 1,024-token Mamba blocks, 16 would
    split prefill chunks off the Mamba grid, so no Mamba state lands on it and no prefix hits
    locally."""
    mamba = [b for kind, b in groups if kind == "mamba"]
    return max(mamba) if mamba else min(b for _, b in groups)


def kv_cache_config(num_blocks: int, groups: tuple[tuple[str, int], ...], h: int) -> Any:
    """The capture engine's ``KVCacheConfig`` with two layers per group (the workers' tensors
    then hold several layers per block)."""
    return capture_engine.kv_cache_config(num_blocks, groups, h, layers_per_group=2)


class Engine:
    """One engine: real Scheduler + N simulated workers, each with a worker connector.
    ``model_runner``: the workers' order (``WorkerRanks``; unset: V1 on 0.33, V2 on 0.34)."""

    def __init__(self, extra: dict[str, Any] | None = None, *, num_blocks: int = 64,
                 groups: tuple[tuple[str, int], ...] = GROUPS, h: int = 4,
                 num_workers: int = 1, kv_role: str = "kv_both", max_batched: int = 2048,
                 failure_policy: str = "recompute", settle: bool = True,
                 max_model_len: int = 4096, model_runner: str | None = None):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tailproof.impl.connector import TailproofConnector
        from tailproof.impl.vllm_plugin import register
        from tailproof.spec.arithmetic import lcm_all

        register()  # the scheduler hook vLLM loads from our entry point (docs/junctions.md)

        init_none_hash(sha256)
        self.settle = settle
        self.h = h
        self.groups = groups
        self.vc = vllm_config(extra or {"store": "memory"}, kv_role, h, cache_block_size(groups),
                              max_batched, failure_policy, max_model_len)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.kvc = kv_cache_config(num_blocks, groups, h)
        lcm = lcm_all([b for _, b in groups])
        self.sched = Scheduler(self.vc, self.kvc, StructuredOutputManager(self.vc),
                               block_size=lcm, hash_block_size=h, log_stats=True)
        self.conn = self.sched.connector
        assert isinstance(self.conn, TailproofConnector)
        self.conn.scheduler_side.num_workers = num_workers
        self.conn.scheduler_side.lookup_client.world = num_workers
        self.ranks = WorkerRanks(self.vc, self.kvc, groups, num_blocks, num_workers,
                                 layers=2, settle=settle, model_runner=model_runner)
        self.workers = self.ranks.workers  # (worker connector, SimRunner) per rank
        self.log: list[StepLog] = []
        self._n = 0

    # ------------------------------------------------------------------ requests

    def add(self, rid: str, prompt: list[int], max_tokens: int = 1) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        req = Request(rid, prompt, sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.h, sha256))
        self.sched.add_request(req)
        return req

    @staticmethod
    def next_token(req: Any) -> int:
        """Deterministic 'sampling': a function of the sequence so far."""
        return 1000 + (sum(req.all_token_ids) * 31 + len(req.all_token_ids)) % 997

    # ------------------------------------------------------------------ one step

    def step(self) -> StepLog:
        so = self.sched.schedule()
        mro, log = self.ranks.step(self.sched, so, self.next_token)
        eco = self.sched.update_from_output(so, mro)
        for o in eco.values():
            log.finished += [x.request_id for x in o.outputs if x.finish_reason is not None]
        self.log.append(log)
        return log

    def run(self, max_steps: int = 50) -> list[StepLog]:
        """Step until no request is left and every store job reported (pins released)."""
        logs = []
        for _ in range(max_steps):
            if not self.sched.has_requests() and not self.conn.has_pending_push_work():
                break
            logs.append(self.step())
            if not logs[-1].scheduled:
                self.wait_workers(0.05)  # nothing to compute: let background jobs progress
        return logs

    def wait_workers(self, timeout: float | None = None) -> bool:
        """Wait until every worker's loads and store jobs finished."""
        return self.ranks.wait_idle(timeout)

    # ------------------------------------------------------------------ inspection

    def refcounts(self) -> dict[int, int]:
        pool = self.sched.kv_cache_manager.block_pool
        return {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt > 0}

    def shutdown(self) -> None:
        self.ranks.shutdown()
        self.conn.shutdown()
