"""vLLM 0.33's real ``Scheduler`` with ``TailproofConnector``, on CPU, model runner by hand.

The scheduler builds its connector from ``--kv-transfer-config`` exactly as ``vllm serve``
does (``KVConnectorFactory`` + ``kv_connector_module_path``); the calling order (lookups,
allocations, boundary hand-offs, finish hooks, connector output) is therefore vLLM's own. What
is played by hand is the GPU worker's side of each step, in the order of vLLM's
``KVConnectorModelRunnerMixin``: apply the step's CoW copies, bind the metadata, "forward"
(``SimRunner`` writes prefix-derived bytes), ``start_load_kv``, ``wait_for_save``, transfer
results, load errors, stats, worker metadata; outputs of all workers are combined with vLLM's
``KVOutputAggregator``. Every load is checked byte for byte when its worker reports it finished
(and a synchronous one right after ``start_load_kv``).

Loads and store jobs run on the connector's background threads. ``settle=True`` (the default)
waits for them at the end of each worker step, so a test sees the same steps every run;
``settle=False`` lets them run free (the stress tests), and :meth:`Engine.run` then only waits
when a step had nothing to schedule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tailproof.conformance.capture import tiny_hybrid  # noqa: E402

GROUPS = (("full_attention", 16), ("mamba", 16))


@dataclass
class StepLog:
    """What one engine step did (for assertions)."""

    scheduled: dict[str, int]
    loads: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    byte_errors: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    worker_stats: list[dict[str, Any]] = field(default_factory=list)  # each worker's counters
    preempted: list[str] = field(default_factory=list)


_BASE_CONFIG: dict[int, Any] = {}  # ModelConfig per max_model_len


def vllm_config(extra: dict[str, Any], kv_role: str = "kv_both", h: int = 4,
                block_size: int = 16, max_batched: int = 2048,
                failure_policy: str = "recompute", max_model_len: int = 4096) -> Any:
    """A CPU ``VllmConfig`` for the tiny hybrid model with the Tailproof connector."""
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
    kt = KVTransferConfig(kv_connector="TailproofConnector",
                          kv_connector_module_path="tailproof.impl.connector",
                          kv_role=kv_role, kv_connector_extra_config=dict(extra),
                          kv_load_failure_policy=failure_policy)
    sc = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=16,
                         max_model_len=max_model_len, is_encoder_decoder=False)
    return VllmConfig(model_config=_BASE_CONFIG[max_model_len], cache_config=cc,
                      device_config=DeviceConfig("cpu"), kv_transfer_config=kt,
                      scheduler_config=sc)


def kv_cache_config(num_blocks: int, groups: tuple[tuple[str, int], ...], h: int) -> Any:
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens  # noqa: F401
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from tailproof.spec.arithmetic import lcm_all

    specs = []
    for g, (kind, bs) in enumerate(groups):
        names = [f"g{g}.l0", f"g{g}.l1"]
        if kind == "mamba":
            spec = MambaSpec(block_size=bs, shapes=((3,), (5,)),
                             dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")
        else:
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=4,
                                     dtype=torch.float32)
        specs.append(KVCacheGroupSpec(names, spec))
    lcm = lcm_all([bs for _, bs in groups])
    partial = any(k == "mamba" and bs > h for k, bs in groups)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                         hash_block_size=h, cache_hit_alignment_tokens=h if partial else lcm)


class Engine:
    """One engine: real Scheduler + N simulated workers, each with a worker connector."""

    def __init__(self, extra: dict[str, Any] | None = None, *, num_blocks: int = 64,
                 groups: tuple[tuple[str, int], ...] = GROUPS, h: int = 4,
                 num_workers: int = 1, kv_role: str = "kv_both", max_batched: int = 2048,
                 failure_policy: str = "recompute", settle: bool = True,
                 max_model_len: int = 4096):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tailproof.conformance.adapters.runner_sim import GroupShape, SimRunner
        from tailproof.impl.connector import TailproofConnector
        from tailproof.spec.arithmetic import lcm_all

        init_none_hash(sha256)
        self.settle = settle
        self.h = h
        self.groups = groups
        self.vc = vllm_config(extra or {"store": "memory"}, kv_role, h, min(b for _, b in groups),
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
        shapes = [GroupShape("mamba" if k == "mamba" else "full_attention", b, layers=2)
                  for k, b in groups]
        self.workers: list[tuple[Any, Any]] = []
        for r in range(num_workers):
            wc = TailproofConnector(self.vc, KVConnectorRole.WORKER, self.kvc)
            wc.worker_side.rank, wc.worker_side.world = r, num_workers
            runner = SimRunner(shapes, num_blocks, rank=r)
            wc.register_kv_caches(runner.kv)
            self.workers.append((wc, runner))
        self.agg = KVOutputAggregator(num_workers)
        self.loading: list[dict[str, Any]] = [{} for _ in range(num_workers)]  # rid -> LoadJob
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
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        log = StepLog(dict(so.num_scheduled_tokens), list(meta.loads), list(meta.stores),
                      [(c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies or ()])
        log.preempted = sorted(so.preempted_req_ids or ())
        reqs = self.sched.requests
        outs = []
        for w, (wc, runner) in enumerate(self.workers):
            assert not set(so.num_scheduled_tokens) & set(self.loading[w]), (
                "a request was scheduled before its load finished")
            runner.copy_blocks(log.copies)
            wc.bind_connector_metadata(meta)
            for rid, n in so.num_scheduled_tokens.items():
                req = reqs[rid]
                end = req.num_computed_tokens
                tables = self.sched.kv_cache_manager.get_block_ids(rid)
                runner.forward(rid, req.all_token_ids, end - n, end, tables)
            wc.start_load_kv(None)
            ws = wc.worker_side
            for job in meta.loads:
                if job.is_async:
                    self.loading[w][job.req_id] = job
                    continue
                failed_sync = any(b in ws.load_error_blocks for g in job.block_ids for b in g)
                if not failed_sync:  # a sync load fed this step's forward: check it now
                    self._check_load(runner, job, log)
            wc.wait_for_save()
            if self.settle:
                assert ws.wait_idle(60.0), "background store jobs did not finish"
            res = wc.get_transfer_results(so.finished_req_ids)
            stats = wc.get_kv_connector_stats()
            log.worker_stats.append(dict(stats.data) if stats is not None else {})
            for rid in res.finished_recving or ():
                job = self.loading[w].pop(rid)
                if rid not in (res.failed_recving or ()):  # failed closed: nothing to check
                    self._check_load(runner, job, log)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
                invalid_block_ids=wc.get_block_ids_with_load_errors(),
                kv_connector_stats=stats,
                kv_connector_worker_meta=wc.build_connector_worker_meta())
            wc.clear_connector_metadata()
            rids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in rids:
                req = reqs[rid]
                done = req.num_computed_tokens >= req.num_tokens
                sampled.append([self.next_token(req)] if done else [])
            outs.append(ModelRunnerOutput(req_ids=rids,
                                          req_id_to_index={r: i for i, r in enumerate(rids)},
                                          sampled_token_ids=sampled, kv_connector_output=kvo))
        mro = self.agg.aggregate(outs)
        eco = self.sched.update_from_output(so, mro)
        for o in eco.values():
            log.finished += [x.request_id for x in o.outputs if x.finish_reason is not None]
        self.log.append(log)
        return log

    def _check_load(self, runner: Any, job: Any, log: StepLog) -> None:
        """The loaded blocks hold exactly the KV of the request's prefix."""
        req = self.sched.requests[job.req_id]
        start = job.vllm_cached_tokens // self.sched.block_size * self.sched.block_size
        log.byte_errors += runner.check(job.req_id, req.all_token_ids, start,
                                        job.kvpool_cached_tokens, job.block_ids)

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
        return all(wc.worker_side.wait_idle(timeout) for wc, _ in self.workers)

    # ------------------------------------------------------------------ inspection

    def refcounts(self) -> dict[int, int]:
        pool = self.sched.kv_cache_manager.block_pool
        return {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt > 0}

    def shutdown(self) -> None:
        for wc, _ in self.workers:
            wc.shutdown()
        self.conn.shutdown()
