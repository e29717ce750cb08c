"""Connector adapter over vLLM's own Mooncake store code (0.33 or 0.34), without ZMQ, threads
or GPUs.

- scheduler role: a real ``MooncakeStoreScheduler`` built with ``object.__new__`` and the
  attributes its ``__init__`` sets (MS:138-205), bound to the real ``BlockPool`` of the vLLM core
  backend; ``build_connector_meta`` gets a stand-in ``SchedulerOutput`` with exactly the fields
  it reads;
- worker role: one real ``KVCacheStoreSendingThread`` per rank (never started: its
  ``_handle_request`` runs synchronously), keyed per rank like a TP deployment, and one bare
  ``MooncakeStoreWorker`` per rank for ``lookup`` and ``_close_ended_store_requests``;
- store: the trace-scripted in-memory store (``reference.connector.store.ScriptedStore``) with
  Mooncake's ``batch_is_exist`` / ``batch_put_from_multi_buffers`` surface.

CUDA events are absent (``current_event`` is None): the fence they provide is a GPU ordering
concern outside what a trace can observe.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from types import SimpleNamespace
from typing import Any

from tailproof.conformance.harness.adapters.base import (
    KV_ROLE,
    ConnectorAdapter,
    ConnStep,
    kv_blocks,
    store_context,
)
from tailproof.conformance.harness.adapters.vllm_core import scheduler_output
from tailproof.conformance.vllm_release import mooncake_layout_module
from tailproof.reference.connector.store import ScriptedStore


def _m() -> SimpleNamespace:
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        ChunkedTokenDatabase,
        KeyMetadata,
        MooncakeStoreWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
        MooncakeStoreScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        KVCacheStoreSendingThread,
        MooncakeStoreWorker,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    pool_key = importlib.import_module(mooncake_layout_module()).PoolKey
    # Scripted store failures make the sending thread log warnings and errors by design.
    # (Set once: each setLevel clears the cache of every logger.)
    for mod in ("worker", "scheduler"):
        log = logging.getLogger(f"{MooncakeStoreScheduler.__module__.rsplit('.', 1)[0]}.{mod}")
        if log.level != logging.CRITICAL:
            log.setLevel(logging.CRITICAL)

    return SimpleNamespace(
        MooncakeStoreCoordinator=MooncakeStoreCoordinator,
        ChunkedTokenDatabase=ChunkedTokenDatabase, KeyMetadata=KeyMetadata,
        MooncakeStoreWorkerMetadata=MooncakeStoreWorkerMetadata, PoolKey=pool_key,
        MooncakeStoreScheduler=MooncakeStoreScheduler,
        KVCacheStoreSendingThread=KVCacheStoreSendingThread,
        MooncakeStoreWorker=MooncakeStoreWorker,
        MambaSpec=MambaSpec)


def store_ranks(coord: Any, store_groups: list[Any], lcm: int, h: int, num_workers: int,
                role: str, stores: list[Any],
                lookup_store: Any) -> tuple[list[list[Any]], list[Any], list[Any]]:
    """The worker side of ``num_workers`` Mooncake store ranks without GPUs: per rank, its
    ``ChunkedTokenDatabase`` per store group (keyed under its own ``tp_rank``, like a TP
    deployment), a real ``KVCacheStoreSendingThread`` over ``stores[rank]`` (never started:
    ``_handle_request`` is run by the caller) and a bare ``MooncakeStoreWorker`` for
    ``lookup`` (over ``lookup_store``) and ``_close_ended_store_requests``."""
    m = _m()
    dbs = [[m.ChunkedTokenDatabase(
        m.KeyMetadata("tailproof", r, 0, 0, 0, group_id=g), grp.kv_cache_spec.block_size,
        h) for g, grp in enumerate(store_groups)] for r in range(num_workers)]
    for rank_dbs in dbs:
        for db in rank_dbs:
            db.set_kv_caches_base_addr([0])
            db.set_block_len([1])
    threads = [m.KVCacheStoreSendingThread(
        stores[r], coord, dbs[r], lcm, r, [1] * len(store_groups), role, threading.Event(),
        replicate_config=None) for r in range(num_workers)]
    workers = []
    for r in range(num_workers):
        w = object.__new__(m.MooncakeStoreWorker)
        w._capacity_only = False
        w.coord = coord
        w.token_dbs = dbs[r]
        w._kv_cache_groups = store_groups
        w.hash_block_size = h
        w.store = lookup_store
        w._lookup_key_prefixes = tuple(
            tuple(m.PoolKey.build_prefix(db.metadata, tp_rank=rank)
                  for rank in range(num_workers)) for db in dbs[r])
        w._record_kv_connector_operation = lambda *a, **k: None
        # 0.34 (MooncakeStoreWorker.__init__): lookups probe through a selective lease only
        # with VLLM_MOONCAKE_STORE_SELECTIVE_LEASE; lookup reads the attribute either way.
        w._selective_lease = None
        w.kv_send_thread = threads[r]
        w.finished_store_req = set()
        workers.append(w)
    return dbs, threads, workers


class _Store(ScriptedStore):
    """The scripted store behind Mooncake's store API; tags each put key for observation."""

    def __init__(self) -> None:
        super().__init__()
        self.context: tuple[str, dict[str, int]] = ("", {})  # (writer rid, hash hex -> bnd)

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any,
                                     replicate_config: Any) -> list[int]:
        return self.put(keys, [self.tag(k) for k in keys])

    def tag(self, key: str) -> tuple[int, int, int, str]:
        rid, boundary_of = self.context
        parts = key.split("@")
        rank = int(next(p for p in parts if p.startswith("tp_rank:")).split(":")[1])
        group = int(next(p for p in parts if p.startswith("group:")).split(":")[1])
        return rank, group, boundary_of[parts[-1]], rid


class LookupClient:
    """``LookupKeyClient`` without ZMQ: asks rank 0's worker directly."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def lookup(self, req_id: str, num_tokens: int, block_hashes: Any,
               non_block: bool = False) -> Any:
        return self.worker.lookup(num_tokens, block_hashes)

    def discard(self, req_id: str) -> None:
        return None

    def prefetch(self, req_id: str, num_tokens: int, block_hashes: Any) -> bool:
        """0.34's ``LookupKeyClient.prefetch`` with no prefetch slot (``lookup_prefetch_limit``
        0, its default): the scheduler looks up as usual."""
        return False


class VllmMooncakeConnector(ConnectorAdapter):
    """vLLM's Mooncake store connector (see module docstring); the core backend is used only
    to build it (its ``KVCacheConfig``, partial hits and ``BlockPool``)."""

    def __init__(self, config: Any, core_backend: Any) -> None:
        super().__init__(config)
        m = self.m = _m()
        kv_config = core_backend.kv_cache_config
        h = config.hash_block_size
        lcm = config.scheduler_block_size
        alignment = h if core_backend.partial_hits else lcm
        store_groups = list(kv_config.prefix_cacheable_groups)
        # 0.34 (MooncakeStoreCoordinator.from_kv_cache_config) also passes the engine's
        # num_hash_lookahead_tokens; a trace's engine hashes no lookahead (the core backend's
        # split runs with 0), which is 0.33's coordinator.
        lookahead = ({"num_hash_lookahead_tokens": 0} if "num_hash_lookahead_tokens"
                     in inspect.signature(m.MooncakeStoreCoordinator).parameters else {})
        self.coord = m.MooncakeStoreCoordinator(
            store_groups, lcm, h, use_eagle=config.use_eagle,
            retention_interval=kv_config.prefix_cache_retention_interval,
            enable_partial_hash_hits=alignment < lcm, **lookahead)
        self.store = _Store()
        self.num_workers = n = self.conf["num_workers"]
        role = KV_ROLE[self.conf["role"]]
        self.dbs, self.threads, self.workers = store_ranks(
            self.coord, store_groups, lcm, h, n, role, [self.store] * n, self.store)
        self.sched = self._scheduler(kv_config, role, lcm, h, store_groups, core_backend)

    def _scheduler(self, kv_config: Any, role: str, lcm: int, h: int, store_groups: list[Any],
                   core_backend: Any) -> Any:
        """``MooncakeStoreScheduler.__init__`` (MS:138-205) minus the ZMQ lookup client."""
        m = self.m
        s = object.__new__(m.MooncakeStoreScheduler)
        s.kv_role = role
        s.load_async = self.conf["load_async"]
        s.lookup_async = False
        s.enable_lookup = self.conf["enable_lookup"]
        s.save_decode_cache = self.conf["save_decode_cache"]
        s.enable_kv_events = False
        s.client = LookupClient(self.workers[0])
        s.kv_cache_config = kv_config
        s._store_group_ids = kv_config.prefix_cacheable_group_ids
        s._store_group_id_by_kv_cache_group_id = {
            gid: sgid for sgid, gid in enumerate(s._store_group_ids)}
        s._block_size, s._hash_block_size = lcm, h
        s._boundary_state_group_ids = frozenset(
            g for g, grp in enumerate(store_groups) if isinstance(grp.kv_cache_spec, m.MambaSpec))
        s._capacity_only = (role == "kv_consumer" and not s.enable_lookup
                            and not s.save_decode_cache)
        s._store_coord = None if s._capacity_only else self.coord
        s.enable_partial_hash_hits = self.coord.enable_partial_hash_hits
        s._gpu_block_pool = None
        s._num_workers = self.num_workers
        s._next_store_job_id = 0
        s._pinned_saves = {}
        s.load_specs = {}
        s._request_trackers = {}
        s._unfinished_requests = {}
        s._unfinished_request_ids = set()
        s._finished_partial_tail_metas = {}
        s._finished_lookahead_metas = {}  # 0.34: finish-time saves of lookahead hashes
        s.bind_gpu_block_pool(core_backend.block_pool)
        return s

    # --- scheduler side ----------------------------------------------------------------

    def after_alloc(self, req: Any, table: tuple[list[int], ...], external: int) -> None:
        self.sched.update_state_after_alloc(req, kv_blocks(table), external)

    def build(self, step: ConnStep) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        meta = self.sched.build_connector_meta(scheduler_output(step))
        jobs = [self.job_obs(r) for r in meta.requests if r.can_save]
        loads = [{"rid": r.req_id, "local": r.load_spec.vllm_cached_tokens,
                  "external": r.load_spec.kvpool_cached_tokens}
                 for r in meta.requests if r.load_spec is not None]
        for w, thread in zip(self.workers, self.threads, strict=True):
            if self.can_put:  # MooncakeStoreWorker.wait_for_save (MW:1957-1977)
                for r in meta.requests:
                    if r.can_save:
                        thread.add_request(copy.copy(r))
            # get_finished -> _close_ended_store_requests (MW:1979-1990)
            self.m.MooncakeStoreWorker._close_ended_store_requests(w, set(step.finished), meta)
        return jobs, loads

    def held(self) -> dict[int, tuple[list[int], int]]:
        return self.sched._pinned_saves

    def register(self, req: Any, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        before = self.sched._next_store_job_id
        delay = self.sched.register_finished_partial_tail(req, block_ids, tails)
        assert delay is False
        if self.sched._next_store_job_id == before:
            return None
        return self.job_obs(self.sched._finished_partial_tail_metas[req.request_id])

    def request_trackers(self) -> dict[str, Any]:
        return self.sched._request_trackers

    # --- workers -----------------------------------------------------------------------

    def run_one(self, w: int) -> tuple[int, str, str | None] | None:
        thread = self.threads[w]
        if thread.request_queue.empty():
            return None
        req = thread.request_queue.get_nowait()
        self.store.context = store_context(req.req_id, req.block_hashes,
                                           self.trace_config.hash_block_size)
        try:
            thread._handle_request(req)
        except Exception as e:  # noqa: BLE001 - the thread logs and carries on
            return req.store_job_id, req.req_id, type(e).__name__
        return req.store_job_id, req.req_id, None

    def worker_state(self, w: int) -> dict[str, Any]:
        t = self.threads[w]
        return {"pressure": t._store_pressure_active, "skipped": sorted(t._skip_store_requests),
                "offsets": {r: n for r, n in sorted(t._saved_offset.items())},
                "queued": [r.store_job_id for r in list(t.request_queue.queue)]}

    def take_completed(self, w: int) -> dict[int, int]:
        return self.threads[w].take_completed_saves()

    def report(self, completed: dict[int, int]) -> list[int]:
        before = set(self.sched._pinned_saves)
        meta = self.m.MooncakeStoreWorkerMetadata(completed_saves=dict(completed))
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
        return self._released(before, completed)

    # --- lookups and store -------------------------------------------------------------

    def store_lookup(self, req: Any, n: int) -> tuple[int, list[tuple[int, int]]]:
        res = self.workers[0].lookup(n, req.block_hashes)
        return res.hit_length, [(t.group_id, t.num_tokens) for t in res.tail_key_boundaries]

    def matched(self, req: Any, num_computed: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(req, num_computed)

    def store_key(self, rank: int, group: int, block_hash: Any) -> str:
        # RankLocalStoreLayout.key_for(0, hash): what 0.33's ChunkedTokenDatabase.key_for
        # returned; 0.34 removed that method and keeps the layout's.
        return self.dbs[rank][group].store_layout.key_for(0, block_hash)
