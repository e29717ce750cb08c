"""In-process worker ranks for an engine whose scheduler runs ``TailproofConnector``.

Plays the GPU worker's side of each engine step in the order of vLLM 0.33's
``KVConnectorModelRunnerMixin``: apply the step's CoW copies, bind the metadata, "forward"
(``SimRunner`` writes prefix-derived bytes), ``start_load_kv``, ``wait_for_save``, transfer
results, load errors, stats, worker metadata; the ranks' outputs are combined with vLLM's
``KVOutputAggregator``. Every load is checked byte for byte when its worker reports it
finished (a synchronous one right after ``start_load_kv``). Used by ``tailproof capture
--connector tailproof`` and by the connector tests' engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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


class WorkerRanks:
    """``num_workers`` worker connectors, each with a ``SimRunner`` holding its KV tensors.

    ``settle=True`` waits for each rank's background store jobs at the end of its step (the
    same steps every run); ``settle=False`` lets them run free."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any,
                 groups: tuple[tuple[str, int], ...], num_blocks: int, num_workers: int,
                 *, layers: int = 1, settle: bool = True) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tailproof.conformance.adapters.runner_sim import GroupShape, SimRunner
        from tailproof.impl.connector import TailproofConnector

        self.settle = settle
        shapes = [GroupShape("mamba" if k == "mamba" else "full_attention", b, layers=layers)
                  for k, b in groups]
        self.workers: list[tuple[Any, Any]] = []
        for r in range(num_workers):
            wc = TailproofConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            wc.worker_side.rank, wc.worker_side.world = r, num_workers
            runner = SimRunner(shapes, num_blocks, rank=r)
            wc.register_kv_caches(runner.kv)
            self.workers.append((wc, runner))
        self.agg = KVOutputAggregator(num_workers)
        self.loading: list[dict[str, Any]] = [{} for _ in range(num_workers)]  # rid -> LoadJob

    @property
    def connectors(self) -> list[Any]:
        """The worker connectors, in rank order."""
        return [wc for wc, _ in self.workers]

    def step(self, sched: Any, so: Any, next_token: Callable[[Any], int]) -> tuple[Any, StepLog]:
        """Run every rank's side of the step ``so`` scheduled; returns the aggregated
        ``ModelRunnerOutput`` (``next_token`` samples a request whose prefill is done) and
        the step's log."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        meta = so.kv_connector_metadata
        log = StepLog(dict(so.num_scheduled_tokens), list(meta.loads), list(meta.stores),
                      [(c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies or ()])
        log.preempted = sorted(so.preempted_req_ids or ())
        reqs = sched.requests
        outs = []
        for w, (wc, runner) in enumerate(self.workers):
            assert not set(so.num_scheduled_tokens) & set(self.loading[w]), (
                "a request was scheduled before its load finished")
            runner.copy_blocks(log.copies)
            wc.bind_connector_metadata(meta)
            for rid, n in so.num_scheduled_tokens.items():
                req = reqs[rid]
                end = req.num_computed_tokens
                tables = sched.kv_cache_manager.get_block_ids(rid)
                runner.forward(rid, req.all_token_ids, end - n, end, tables)
            wc.start_load_kv(None)
            ws = wc.worker_side
            for job in meta.loads:
                if job.is_async:
                    self.loading[w][job.req_id] = job
                    continue
                failed_sync = any(b in ws.load_error_blocks for g in job.block_ids for b in g)
                if not failed_sync:  # a sync load fed this step's forward: check it now
                    self._check_load(sched, runner, job, log)
            wc.wait_for_save()
            if self.settle:
                assert ws.wait_idle(60.0), "background store jobs did not finish"
            res = wc.get_transfer_results(so.finished_req_ids)
            stats = wc.get_kv_connector_stats()
            log.worker_stats.append(dict(stats.data) if stats is not None else {})
            for rid in res.finished_recving or ():
                job = self.loading[w].pop(rid)
                if rid not in (res.failed_recving or ()):  # failed closed: nothing to check
                    self._check_load(sched, runner, job, log)
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
                sampled.append([next_token(req)] if done else [])
            outs.append(ModelRunnerOutput(req_ids=rids,
                                          req_id_to_index={r: i for i, r in enumerate(rids)},
                                          sampled_token_ids=sampled, kv_connector_output=kvo))
        return self.agg.aggregate(outs), log

    @staticmethod
    def _check_load(sched: Any, runner: Any, job: Any, log: StepLog) -> None:
        """The loaded blocks hold exactly the KV of the request's prefix."""
        req = sched.requests[job.req_id]
        start = job.vllm_cached_tokens // sched.block_size * sched.block_size
        log.byte_errors += runner.check(job.req_id, req.all_token_ids, start,
                                        job.kvpool_cached_tokens, job.block_ids)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every rank's loads and store jobs finished."""
        return all(wc.worker_side.wait_idle(timeout) for wc, _ in self.workers)

    def shutdown(self) -> None:
        for wc, _ in self.workers:
            wc.shutdown()
