"""In-process worker ranks for an engine whose scheduler runs vLLM 0.33's
``MooncakeStoreConnector`` (``tailproof capture --connector mooncake``).

The scheduler side is vLLM's own connector, built by the ``Scheduler`` from
``--kv-transfer-config``; only its ZMQ lookup client is replaced by a direct call into rank
0's ``MooncakeStoreWorker.lookup``. Each rank's store path is vLLM's own code too: a real
``KVCacheStoreSendingThread`` (its ``_handle_request`` run synchronously, like the
``vllm-mooncake`` adapter) over an embedded in-memory store with Mooncake's
``batch_is_exist`` / ``batch_put_from_multi_buffers`` surface (``EmbeddedStore``) in place of a
``MooncakeDistributedStore`` and its master. There are no KV tensors: puts store keys only,
and an asynchronous load lands in the step that issued it without moving bytes (the
``tailproof`` connector's capture checks bytes; this one checks what the scheduler and the
sending thread decide).

Per engine step each rank plays vLLM's worker order (``MooncakeStoreConnector``):
``wait_for_save`` queues the step's saving jobs, ``get_finished`` retires ended ledgers
(``_close_ended_store_requests``) and reports the loads, the sending thread runs the jobs, and
``build_connector_worker_meta`` reports the completed saves; the ranks' outputs are combined
with vLLM's ``KVOutputAggregator``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from tailproof.conformance.capture.connector_recorder import REFUSALS
from tailproof.conformance.harness.adapters.vllm_mooncake import LookupClient, store_ranks
from tailproof.conformance.tools.capture_engine.workers import StepLog
from tailproof.conformance.vllm_release import model_runner_output
from tailproof.reference.connector.store import ScriptedStore, StoreRaised, codes_for

_ROLE_OK = ("kv_producer", "kv_both")


class EmbeddedStore(ScriptedStore):
    """The keys every rank put (a ``ScriptedStore``: present keys with a tag each)."""


class RankStore:
    """One rank's view of the ``EmbeddedStore``: each put batch's outcome is scripted by
    ``plan()`` (``ok``, ``full``, ``error``, ``timeout``); ``take`` returns the
    ``worker_run.store`` script of the batches since the last call."""

    def __init__(self, inner: EmbeddedStore, plan: Callable[[], str] | None = None) -> None:
        self.inner = inner
        self.plan = plan
        self.entries: list[str] = []

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self.inner.batch_is_exist(keys)

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any,
                                     replicate_config: Any) -> list[int]:
        what = self.plan() if self.plan is not None else "ok"
        entry = "ok" if what == "ok" else REFUSALS[what][0]
        self.entries.append(entry)
        codes = codes_for(entry, len(keys))
        if codes is None:
            raise StoreRaised("scripted store exception")
        for key, code in zip(keys, codes, strict=True):
            if code >= 0:
                self.inner.keys[key] = True
        return codes

    def take(self) -> list[str]:
        out, self.entries = self.entries, []
        while out and out[-1] == "ok":
            out.pop()
        return out


class MooncakeRank:
    """One worker rank: the step's jobs go through ``wait_for_save`` (queued, ledgers
    retired, run to completion: the recorder's ``worker_run``)."""

    def __init__(self, worker: Any, thread: Any, store: RankStore, can_put: bool) -> None:
        self.worker = worker
        self.thread = thread
        self.store = store
        self.can_put = can_put
        self.meta: Any = None
        self.finished: set[str] = set()

    def refusing_store(self, plan: Callable[[], str]) -> RankStore:
        """Script this rank's put outcomes (for the recorder's ``worker_run.store``)."""
        self.store.plan = plan
        return self.store

    def wait_for_save(self) -> None:
        """``MooncakeStoreWorker.wait_for_save`` then ``get_finished``'s
        ``_close_ended_store_requests`` (MW), then the sending thread's FIFO run."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
            MooncakeStoreWorker,
        )

        meta = self.meta
        if self.can_put:
            for r in meta.requests:
                if r.can_save:  # the thread may mutate its copy (one meta, several ranks)
                    self.thread.add_request(copy.copy(r))
            MooncakeStoreWorker._close_ended_store_requests(self.worker, self.finished, meta)
        q = self.thread.request_queue
        while not q.empty():
            req = q.get_nowait()
            # The real thread logs and carries on past a failed job (KVTransferThread.run).
            try:
                self.thread._handle_request(req)
            except Exception:  # noqa: BLE001, S112 - as the sending thread does
                continue


class MooncakeRanks:
    """``num_workers`` ranks beside a ``Scheduler`` running ``MooncakeStoreConnector``."""

    def __init__(self, sched: Any, kv_cache_config: Any, num_workers: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        cs = sched.connector.connector_scheduler
        store_groups = list(kv_cache_config.prefix_cacheable_groups)
        self.store = EmbeddedStore()
        rank_stores = [RankStore(self.store) for _ in range(num_workers)]
        _, threads, workers = store_ranks(cs._store_coord, store_groups, cs._block_size,
                                          cs._hash_block_size, num_workers, cs.kv_role,
                                          rank_stores, self.store)
        can_put = cs.kv_role in _ROLE_OK
        self.ranks = [MooncakeRank(w, t, s, can_put)
                      for w, t, s in zip(workers, threads, rank_stores, strict=True)]
        zmq_client = cs.client
        cs.client = LookupClient(workers[0])
        cs._num_workers = num_workers
        close = getattr(zmq_client, "close", None)
        if close is not None:
            close()
        self.agg = KVOutputAggregator(num_workers)

    @property
    def connectors(self) -> list[MooncakeRank]:
        """The worker ranks, in rank order (what the recorder wraps)."""
        return self.ranks

    def step(self, sched: Any, so: Any, next_token: Callable[[Any], int]) -> tuple[Any, Any]:
        """Every rank's side of the step ``so`` scheduled; returns the aggregated
        ``ModelRunnerOutput`` and the step's log."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = so.kv_connector_metadata
        log = StepLog(dict(so.num_scheduled_tokens))
        log.preempted = sorted(so.preempted_req_ids or ())
        # start_load_kv: an asynchronous load lands in the step that issued it.
        landed = {r.req_id for r in meta.requests
                  if r.load_spec is not None and r.load_spec.can_load}
        reqs = sched.requests
        rids = list(so.num_scheduled_tokens)
        outs = []
        for rank in self.ranks:
            rank.meta, rank.finished = meta, set(so.finished_req_ids)
            rank.wait_for_save()
            done = rank.thread.take_completed_saves()  # build_connector_worker_meta
            kvo = KVConnectorOutput(
                finished_sending=set(), finished_recving=set(landed), failed_recving=set(),
                invalid_block_ids=set(),
                kv_connector_worker_meta=(MooncakeStoreWorkerMetadata(completed_saves=done)
                                          if done else None))
            sampled = []
            for rid in rids:
                req = reqs[rid]
                sampled.append([next_token(req)] if req.num_computed_tokens >= req.num_tokens
                               else [])
            outs.append(model_runner_output(rids, sampled_token_ids=sampled,
                                            kv_connector_output=kvo))
        return self.agg.aggregate(outs), log

    def shutdown(self) -> None:
        """Nothing runs in the background (the sending threads are never started)."""
