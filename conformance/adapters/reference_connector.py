"""Connector adapter over the reference connector model (``tailproof.reference.connector``),
pinning blocks of the reference core's ``BlockPool``."""

from __future__ import annotations

from typing import Any

from tailproof.conformance.connector_ops import ConnectorAdapter, batch_obs, job_obs
from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.lookup import (
    LookupMemo,
    get_num_new_matched_tokens,
    remembered_lookup,
    store_lookup,
)
from tailproof.reference.connector.meta import ReqMeta
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
    def __init__(self, config: Any, core_backend: Any) -> None:
        super().__init__(config)
        self.core = core_backend
        self.geo = StoreGeometry.from_config(config)
        self.cconf = ConnectorConfig.from_doc(self.conf)
        self.sched = ConnectorScheduler(self.cconf, self.geo, _PoolById(core_backend.block_pool))
        self.store = ScriptedStore()
        self.memos: dict[str, LookupMemo] = {}  # remembered lookups of waiting requests
        self.workers = [SendingWorker(r, self.geo, self.store)
                        for r in range(self.cconf.num_workers)]
        if self.junctions:  # EXTENSION (docs/junctions.md, "The hook")
            self.sched.junctions.hook = core_backend.junction_hook(self.cconf.device_junctions)
            self.sched.junctions.vllm_keys = core_backend.geo.manager_shared_prefix_checkpoint

    def _req(self, rid: str) -> Any:
        return self.core.requests[rid]

    # --- scheduler side ----------------------------------------------------------------

    def after_alloc(self, rid: str, table: tuple[list[int], ...],
                    external: int) -> None:
        self.memos.pop(rid, None)  # admitted: no longer waiting
        self.sched.update_state_after_alloc(self._req(rid), table, external)

    def _job_obs(self, job: ReqMeta) -> dict[str, Any]:
        pins = self.sched.pinned_saves.get(job.store_job_id, ([], 0))[0] \
            if job.store_job_id is not None else []
        return job_obs(job.store_job_id, job.req_id, job.token_ids_start, job.token_len_chunk,
                       job.publish_partial_tail,
                       [(p.group_id, p.block_id, p.num_tokens) for p in job.boundary_puts],
                       pins)

    def build(self, rows: list[tuple[str, int, str, tuple[list[int], ...], int]],
              finished: set[str], preempted: set[str],
              offloads: dict[str, list[tuple[int, int, int]]],
              table: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        for rid in finished:
            self.memos.pop(rid, None)
        scheduled = [Scheduled(self._req(rid), n, kind, ids, computed)
                     for rid, n, kind, ids, computed in rows]
        out = self.sched.build_connector_meta(scheduled, finished, preempted, offloads, table)
        jobs = [self._job_obs(j) for j in out if j.can_save]
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

    def pinned(self) -> dict[int, tuple[list[int], int]]:
        return self.sched.pinned_saves

    def register(self, rid: str, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        job = self.sched.register_finished_partial_tail(self._req(rid), block_ids, tails)
        return self._job_obs(job) if job is not None else None

    def snapshots(self) -> list[tuple[str, int, int, int, int]]:
        return [(s.req_id, s.group, s.src, s.slot, s.boundary)
                for s in self.sched.step_snapshots]

    def finish_turn(self, rid: str, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        job = self.sched.finish_turn(self._req(rid), block_ids)
        return self._job_obs(job) if job is not None else None

    def slots(self) -> dict[str, tuple[list[int], int]]:
        return dict(self.sched.turn_end.slots)

    def junction_targets(self) -> dict[str, int]:
        return dict(self.sched.junctions.targets)

    def trackers(self) -> dict[str, dict[str, Any]]:
        return {rid: {"token_len": t.token_len, "saved": t.num_saved_tokens,
                      "prefill_end": t.prefill_end_tokens, "tail_sent": t.partial_tail_sent}
                for rid, t in sorted(self.sched.request_trackers.items())}

    # --- workers -----------------------------------------------------------------------

    def run_worker(self, w: int, n: int | None,
                   script: Any) -> list[dict[str, Any]]:
        self.store.set_script(script)
        ran = self.workers[w].run(n)
        out = []
        for i, (job, first, err) in enumerate(ran):
            last = ran[i + 1][1] if i + 1 < len(ran) else len(self.store.log)
            entry: dict[str, Any] = {
                "job": job.store_job_id, "rid": job.req_id,
                "batches": [batch_obs(tags, e) for tags, e in self.store.log[first:last]]}
            if err:
                entry["error"] = err
            out.append(entry)
        return out

    def worker_state(self, w: int) -> dict[str, Any]:
        wk = self.workers[w]
        return {**wk.state(), "queued": [j.store_job_id for j in wk.queue]}

    def take_completed(self, w: int) -> dict[int, int]:
        return self.workers[w].take_completed_saves()

    def report(self, completed: dict[int, int]) -> list[int]:
        return self.sched.update_connector_output(completed)

    # --- lookups and store -------------------------------------------------------------

    def _present(self, gid: int, digest: bytes) -> bool:
        return all((r, gid, digest) in self.store.keys for r in range(len(self.workers)))

    def store_lookup(self, rid: str, n: int) -> tuple[int, list[tuple[int, int]]]:
        res = store_lookup(self.geo, n, self._req(rid).block_hashes, self._present)
        return res.hit_length, [tuple(t) for t in res.tail_key_boundaries]

    def matched(self, rid: str, num_computed: int) -> tuple[int | None, bool]:
        req = self._req(rid)

        def lookup() -> Any:
            res, self.memos[rid] = remembered_lookup(
                self.geo, req.num_tokens, req.block_hashes, self._present, self.store.removals,
                self.memos.get(rid))
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

    def seed(self, rid: str, keys: list[tuple[int, ...]], workers: list[int],
             remove: bool) -> int:
        hashes = self._req(rid).block_hashes
        h = self.geo.hash_block_size
        n = 0
        for r in workers:
            for g, b in keys:
                key = (r, g, bytes(hashes[b // h - 1]))
                if remove:
                    n += self.store.remove([key])
                else:
                    self.store.keys[key] = (r, g, b, rid)
                    n += 1
        return n

    def store_tags(self) -> list[tuple[int, int, int, str]]:
        return list(self.store.keys.values())
