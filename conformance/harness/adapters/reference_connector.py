"""Connector adapter over the reference connector model (``tailproof.reference.connector``),
pinning blocks of the reference core's ``BlockPool``."""

from __future__ import annotations

from typing import Any

from tailproof.conformance.harness.adapters.base import ConnectorAdapter, ConnStep
from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.lookup import (
    LookupMemo,
    get_num_new_matched_tokens,
    remembered_lookup,
    store_lookup,
)
from tailproof.reference.connector.scheduler import ConnectorScheduler, Scheduled
from tailproof.reference.connector.store import ScriptedStore
from tailproof.reference.connector.worker import SendingWorker


class _PoolById:
    """``touch`` / ``free_blocks`` of the reference ``BlockPool``, addressed by block id."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def touch_ids(self, ids: list[int]) -> None:
        self.pool.touch([self.pool.blocks[i] for i in ids])

    def free_ids(self, ids: list[int]) -> None:
        self.pool.free_blocks([self.pool.blocks[i] for i in ids])

    def take_ids(self, n: int) -> list[int]:
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()


class ReferenceConnector(ConnectorAdapter):
    """The reference connector model; the core backend is used only to bind its pool."""

    def __init__(self, config: Any, core_backend: Any) -> None:
        super().__init__(config)
        self.geo = StoreGeometry.from_config(config)
        self.cconf = ConnectorConfig.from_doc(self.conf)
        rules = core_backend.geo.release  # the trace's vLLM release (config.vllm)
        self.sched = ConnectorScheduler(self.cconf, self.geo, _PoolById(core_backend.block_pool),
                                        num_blocks=config.num_blocks, rules=rules)
        self.offsets: dict[int, int] = {}  # reported with the completed saves (readable pins)
        self.store = ScriptedStore()
        self.memos: dict[str, LookupMemo] = {}  # remembered lookups of waiting requests
        self.workers = [SendingWorker(r, self.geo, self.store, rules)
                        for r in range(self.cconf.num_workers)]
        if self.junctions:  # EXTENSION (docs/junctions.md, "The hook")
            self.sched.junctions.hook = core_backend.junction_hook(self.cconf.device_junctions)
            self.sched.junctions.vllm_keys = core_backend.geo.manager_shared_prefix_checkpoint

    # --- scheduler side ----------------------------------------------------------------

    def after_alloc(self, req: Any, table: tuple[list[int], ...], external: int) -> None:
        self.memos.pop(req.request_id, None)  # admitted: no longer waiting
        self.sched.update_state_after_alloc(req, table, external)

    def build(self, step: ConnStep) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        finished, preempted = step.finished, step.preempted
        for rid in finished:
            self.memos.pop(rid, None)
        scheduled = [Scheduled(step.ctx.request(r.rid), r.tokens, r.kind, r.block_ids,
                               r.computed) for r in step.rows]
        out = self.sched.build_connector_meta(scheduled, finished, preempted, step.offloads,
                                              step.resolve)
        jobs = [self.job_obs(j) for j in out if j.can_save]
        loads = [{"rid": j.req_id, "local": j.load_spec.vllm_cached_tokens,
                  "external": j.load_spec.kvpool_cached_tokens}
                 for j in out if j.load_spec is not None]
        if self.can_put:
            for w in self.workers:
                for j in out:
                    if j.can_save:
                        w.add_request(j)
        for w in self.workers:
            w.close_ended_store_requests(finished, preempted)
        return jobs, loads

    def held(self) -> dict[int, tuple[list[int], int]]:
        return self.sched.held

    def register(self, req: Any, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        job = self.sched.register_finished_partial_tail(req, block_ids, tails)
        return self.job_obs(job) if job is not None else None

    def snapshots(self) -> list[tuple[str, int, int, int, int]]:
        return [(s.req_id, s.group, s.src, s.slot, s.boundary)
                for s in self.sched.step_snapshots]

    def finish_turn(self, req: Any, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        job = self.sched.finish_turn(req, block_ids)
        return self.job_obs(job) if job is not None else None

    def slots(self) -> dict[str, tuple[list[int], int]]:
        return dict(self.sched.turn_end.slots)

    def junction_targets(self) -> dict[str, int]:
        return dict(self.sched.junctions.targets)

    def request_trackers(self) -> dict[str, Any]:
        return self.sched.request_trackers

    # --- workers -----------------------------------------------------------------------

    def run_one(self, w: int) -> tuple[int, str, str | None] | None:
        if not self.workers[w].queue:
            return None
        ((job, _, err),) = self.workers[w].run(1)
        return job.store_job_id, job.req_id, err

    def worker_state(self, w: int) -> dict[str, Any]:
        wk = self.workers[w]
        return {**wk.state(), "queued": [j.store_job_id for j in wk.queue]}

    def take_completed(self, w: int) -> dict[int, int]:
        for j, off in self.workers[w].take_saved_offsets().items():
            self.offsets[j] = min(off, self.offsets.get(j, off))
        return self.workers[w].take_completed_saves()

    def report(self, completed: dict[int, int]) -> list[int]:
        offsets, self.offsets = self.offsets, {}
        return self.sched.update_connector_output(completed, offsets)

    # --- lookups and store -------------------------------------------------------------

    def _present(self, gid: int, digest: bytes) -> bool:
        return all((r, gid, digest) in self.store.keys for r in range(len(self.workers)))

    def store_lookup(self, req: Any, n: int) -> tuple[int, list[tuple[int, int]]]:
        res = store_lookup(self.geo, n, req.block_hashes, self._present)
        return res.hit_length, [tuple(t) for t in res.tail_key_boundaries]

    def matched(self, req: Any, num_computed: int) -> tuple[int | None, bool]:
        rid = req.request_id

        def lookup() -> Any:
            res, self.memos[rid] = remembered_lookup(
                self.geo, req.num_tokens, req.block_hashes, self._present, self.store.removals,
                self.memos.get(rid), self.store.changes)
            return res

        inflight = self.sched.inflight
        defer = None
        if inflight is not None and inflight.keys:  # EXTENSION rule 7

            def defer(hit: int) -> bool:
                return inflight.awaits(req.num_tokens, req.block_hashes, hit)

        need, load_async = get_num_new_matched_tokens(
            self.geo, self.cconf.enable_lookup, self.cconf.load_async, self.sched.load_specs, rid,
            req.num_tokens, num_computed, lookup, defer)
        self.sched.after_lookup(req, num_computed, need)  # EXTENSION (junctions)
        return need, load_async

    def store_key(self, rank: int, group: int, block_hash: Any) -> tuple[int, int, bytes]:
        return rank, group, bytes(block_hash)
