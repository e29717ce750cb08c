"""In-process worker ranks for an engine whose scheduler runs ``TailproofConnector``.

Plays the GPU worker's side of each engine step in the order of vLLM 0.33's Model Runner V1
(``KVConnectorModelRunnerMixin``, ``model_runner="v1"``, the default on 0.33): apply the step's
CoW copies, bind the metadata, "forward" (``SimRunner`` writes prefix-derived bytes),
``start_load_kv``, ``wait_for_save``, transfer results, load errors, stats, worker metadata; or,
with ``model_runner="v2"`` (the default on 0.34, which has no V1), through Model Runner V2's own
``ActiveKVConnector`` (``v1/worker/gpu/kv_connector.py``: it registers the
caches, then per step ``handle_preemptions``, ``bind_connector_metadata``, the forward,
``finish_forward``, asynchronous loads started after the forward, transfer results, and
``wait_for_save`` -- deferred to ``finalize_step`` after the results with ``"v2-deferred"``, as
V2 does when a speculator runs). The ranks' outputs are combined with vLLM's
``KVOutputAggregator``. Every load is checked byte for byte when its worker reports it
finished (a synchronous one right after ``start_load_kv``). Used by ``tailproof capture
--connector tailproof`` and by the connector tests' engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tailproof.conformance.vllm_release import default_model_runner, model_runner_output


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


MODEL_RUNNERS = ("v1", "v2", "v2-deferred")


def _v2_active_connector(vllm_config: Any, connector: Any, kv: dict[str, Any]) -> Any:
    """Model Runner V2's ``ActiveKVConnector`` around ``connector`` (it registers ``kv``, as
    ``GPUModelRunner.initialize_kv_cache`` does through ``get_kv_connector``)."""
    from unittest import mock

    from vllm.v1.worker.gpu import kv_connector as v2

    # V2 takes the process-global connector; each in-process rank has its own.
    with mock.patch.object(v2, "get_kv_transfer_group", lambda: connector):
        return v2.ActiveKVConnector(vllm_config, kv)


def _settled(wc: Any, results: Callable[[set[str]], Any]) -> Callable[[set[str]], Any]:
    """``get_transfer_results`` that first waits for the rank's background loads and jobs."""
    def settled(finished_req_ids: set[str]) -> Any:
        assert wc.worker_side.wait_idle(60.0), "background loads or jobs did not finish"
        return results(finished_req_ids)
    return settled


class WorkerRanks:
    """``num_workers`` worker connectors, each with a ``SimRunner`` holding its KV tensors.

    ``settle=True`` waits for each rank's background store jobs at the end of its step (the
    same steps every run); ``settle=False`` lets them run free."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any,
                 groups: tuple[tuple[str, int], ...], num_blocks: int, num_workers: int,
                 *, layers: int = 1, settle: bool = True,
                 model_runner: str | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        # deferred with vLLM's: the simulated runner imports torch (seconds)
        from tailproof.conformance.harness.adapters.runner_sim import GroupShape, SimRunner
        from tailproof.impl.connector import TailproofConnector

        if model_runner is None:  # the installed release's own order (0.34: V2 only)
            model_runner = default_model_runner()
        if model_runner not in MODEL_RUNNERS:
            raise ValueError(f"model_runner: {model_runner!r} is not one of {MODEL_RUNNERS}")
        self.settle = settle
        self.model_runner = model_runner
        self.vllm_config = vllm_config
        self.active: list[Any] = []  # V2: one ActiveKVConnector per rank
        shapes = [GroupShape("mamba" if k == "mamba" else "full_attention", b, layers=layers)
                  for k, b in groups]
        self.workers: list[tuple[Any, Any]] = []
        for r in range(num_workers):
            wc = TailproofConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            wc.worker_side.rank, wc.worker_side.world = r, num_workers
            runner = SimRunner(shapes, num_blocks, rank=r)
            if model_runner == "v1":
                wc.register_kv_caches(runner.kv)  # initialize_kv_cache
            else:
                self.active.append(_v2_active_connector(vllm_config, wc, runner.kv))
                if settle:  # V2 collects results right after starting loads: settle there
                    wc.get_transfer_results = _settled(wc, wc.get_transfer_results)
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
            if self.model_runner == "v1":
                kvo = self._v1_step(wc, runner, sched, so, log, w)
            else:
                kvo = self._v2_step(self.active[w], wc, runner, sched, so, log, w)
            rids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in rids:
                req = reqs[rid]
                done = req.num_computed_tokens >= req.num_tokens
                sampled.append([next_token(req)] if done else [])
            outs.append(model_runner_output(rids, sampled_token_ids=sampled,
                                            kv_connector_output=kvo))
        return self.agg.aggregate(outs), log

    def _v1_step(self, wc: Any, runner: Any, sched: Any, so: Any, log: StepLog, w: int) -> Any:
        """One rank's step in ``KVConnectorModelRunnerMixin``'s order (Model Runner V1)."""
        from vllm.v1.outputs import KVConnectorOutput

        meta = so.kv_connector_metadata
        reqs = sched.requests
        wc.bind_connector_metadata(meta)
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            end = req.num_computed_tokens
            tables = sched.kv_cache_manager.get_block_ids(rid)
            runner.forward(rid, req.all_token_ids, end - n, end, tables)
        wc.start_load_kv(None)
        self._note_loads(wc, runner, sched, so, log, w)
        wc.wait_for_save()
        if self.settle:
            assert wc.worker_side.wait_idle(60.0), "background store jobs did not finish"
        res = wc.get_transfer_results(so.finished_req_ids)
        stats = wc.get_kv_connector_stats()
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=wc.get_block_ids_with_load_errors(),
            kv_connector_stats=stats,
            kv_connector_worker_meta=wc.build_connector_worker_meta())
        wc.clear_connector_metadata()
        self._note_results(sched, runner, kvo, log, w)
        return kvo

    def _v2_step(self, active: Any, wc: Any, runner: Any, sched: Any, so: Any, log: StepLog,
                 w: int) -> Any:
        """One rank's step through Model Runner V2's ``ActiveKVConnector``
        (``GPUModelRunner.execute_model`` / ``sample_tokens`` in ``v1/worker/gpu``)."""
        from types import SimpleNamespace

        reqs = sched.requests
        rids = list(so.num_scheduled_tokens)
        if not rids:
            out = active.no_forward(so)
            kvo = out.kv_connector_output
            self._note_loads(wc, runner, sched, so, log, w)
        else:
            batch = SimpleNamespace(req_ids=rids, idx_mapping=list(range(len(rids))),
                                    num_tokens=sum(so.num_scheduled_tokens.values()))
            active.pre_forward(so, batch)
            for rid, n in so.num_scheduled_tokens.items():
                end = reqs[rid].num_computed_tokens
                tables = sched.kv_cache_manager.get_block_ids(rid)
                runner.forward(rid, reqs[rid].all_token_ids, end - n, end, tables)
            active.finish_forward()
            deferred = self.model_runner == "v2-deferred"
            kvo = active.post_forward(so.finished_req_ids, defer_finalize=deferred)
            self._note_loads(wc, runner, sched, so, log, w)
            if deferred:
                active.finalize_step()
        if self.settle:
            assert wc.worker_side.wait_idle(60.0), "background store jobs did not finish"
        self._note_results(sched, runner, kvo, log, w)
        return kvo

    def _note_loads(self, wc: Any, runner: Any, sched: Any, so: Any, log: StepLog,
                    w: int) -> None:
        """After ``start_load_kv``: remember asynchronous loads, check synchronous ones."""
        ws = wc.worker_side
        for job in so.kv_connector_metadata.loads:
            if job.is_async:
                self.loading[w][job.req_id] = job
                continue
            failed_sync = any(b in ws.load_error_blocks for g in job.block_ids for b in g)
            if not failed_sync:  # a sync load fed this step's forward: check it now
                self._check_load(sched, runner, job, log)

    def _note_results(self, sched: Any, runner: Any, kvo: Any, log: StepLog, w: int) -> None:
        """Check each load the rank reported finished (failed ones closed: nothing to check)."""
        stats = kvo.kv_connector_stats if kvo is not None else None
        log.worker_stats.append(dict(stats.data) if stats is not None else {})
        if kvo is None:
            return
        for rid in kvo.finished_recving or ():
            job = self.loading[w].pop(rid)
            if rid not in (kvo.failed_recving or ()):
                self._check_load(sched, runner, job, log)

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
