"""Scheduler role: lookups, load specs, store jobs, pins.

Semantics are those of vLLM 0.33's ``MooncakeStoreScheduler`` (the peer this was learnt from),
restated over plain ints and the boundary arithmetic of ``tailproof.spec.arithmetic``:

* lookups report hash-aligned hits (``lookup.StoreLookup``); loads are asynchronous so a failed
  load is reported per request (``failed_recving``) and recomputed -- vLLM cannot map
  block-level load errors back to requests when there are several KV cache groups;
* normal saves are floored to the lcm block size and emitted when a new lcm block completed or
  when the prompt first completes (its partial tail is then published);
* exact Mamba boundary states come only from the core's hand-offs
  (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads`` during the run,
  ``register_finished_partial_tail`` at finish); decode boundaries, null blocks and
  non-Mamba groups are dropped; the attention blocks of a sub-block tail are put explicitly
  (``tail_put_range``) because normal saves stop at the lcm floor;
* every block a store job may read is pinned (``block_pool.touch``) when the job is emitted
  and released exactly once, when every worker reported the job; so requests never delay
  their own free (``request_finished_all_groups`` answers ``(False, None)``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tailproof.impl.config import Geometry, Settings
from tailproof.impl.lookup import StoreLookup
from tailproof.impl.meta import BoundaryPut, LoadJob, StoreJob, TailproofMeta, TailproofWorkerMeta
from tailproof.impl.metrics import SchedulerMetrics
from tailproof.spec.arithmetic import cdiv, checkpoint_position, tail_put_range

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0


@dataclass
class LoadSpec:
    """A pending external hit: ``local`` tokens computed locally, ``hit`` in the store."""

    local: int
    hit: int
    tail_keys: tuple[int, ...]
    can_load: bool = False


@dataclass
class Tracker:
    """Per running request: what has been computed and saved (reset on preemption)."""

    token_len: int
    block_ids: tuple[list[int], ...]  # append-only mirror (used for offload-only jobs)
    prefill_end: int  # prompt length, or prompt + outputs for a resumed request
    num_saved: int = 0
    tail_sent: bool = False


@dataclass
class _Save:
    """A store job under construction (becomes a ``StoreJob`` once pinned)."""

    req_id: str
    token_len: int
    completed: int
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    publish_tail: bool = False
    boundary_puts: list[BoundaryPut] = field(default_factory=list)
    job_id: int | None = None


class SchedulerSide:
    """The connector's scheduler role (one per engine)."""

    def __init__(
        self, settings: Settings, geom: Geometry, lookup: StoreLookup | None,
        num_workers: int, metrics: SchedulerMetrics | None = None,
    ):
        self.settings = settings
        self.geom = geom
        self.lookup_client = lookup
        self.num_workers = num_workers
        self.metrics = metrics or SchedulerMetrics()
        self.pool: Any = None
        self.next_job_id = 0
        self.pinned: dict[int, tuple[list[int], int]] = {}  # job -> (block ids, ranks left)
        self.load_specs: dict[str, LoadSpec] = {}
        self.trackers: dict[str, Tracker] = {}
        self.unfinished: dict[str, tuple[Any, tuple[list[int], ...]]] = {}
        self.finished_tails: dict[str, _Save] = {}

    # ------------------------------------------------------------------ lookup / alloc

    def bind_block_pool(self, pool: Any) -> None:
        self.pool = pool

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """External tokens beyond the (block-aligned) local hit; loads are always async."""
        if not self.settings.loads or self.lookup_client is None:
            return 0, False
        if request.num_tokens < self.geom.alignment:
            return 0, False
        res = self.lookup_client.lookup(request.num_tokens, request.block_hashes)
        self.metrics.record_lookup(request.num_tokens, res.hit_tokens, self.geom.lcm_block_size)
        need = res.hit_tokens - num_computed
        if need <= 0:
            return 0, False
        self.load_specs[request.request_id] = LoadSpec(num_computed, res.hit_tokens, res.tail_keys)
        return need, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        ids: tuple[list[int], ...] = ()
        if num_external > 0:
            ids = tuple(blocks.get_block_ids(group_ids=self.geom.core_group_ids))
        self.unfinished[rid] = (request, ids)
        spec = self.load_specs.get(rid)
        if spec is None:
            return
        if num_external == 0:
            spec.can_load = False
            return
        if num_external != spec.hit - spec.local:
            raise AssertionError(
                f"{rid}: scheduler adopted {num_external} external tokens, lookup offered "
                f"{spec.hit} - {spec.local}"
            )
        spec.can_load = True

    # ------------------------------------------------------------------ per-step meta

    def build_meta(self, so: Any) -> TailproofMeta:
        """Turn one ``SchedulerOutput`` into the workers' loads and pinned store jobs."""
        saves = self.settings.saves
        for rid in so.finished_req_ids:
            self.load_specs.pop(rid, None)
            self.trackers.pop(rid, None)
            self.unfinished.pop(rid, None)
        preempted = set(so.preempted_req_ids or ())
        for rid in preempted:
            self.load_specs.pop(rid, None)
            if rid in self.trackers:
                self.trackers[rid] = Tracker(0, (), 0)  # Mooncake's tracker.reset()
            self.unfinished.pop(rid, None)
        meta = TailproofMeta(preempted=preempted, finished=set(so.finished_req_ids))
        pending: list[_Save] = []
        scheduled_new = {r.req_id for r in so.scheduled_new_reqs}
        for nr in so.scheduled_new_reqs:
            self._new_request(nr, so, pending, saves)
        cached = so.scheduled_cached_reqs
        if saves:
            for i, rid in enumerate(cached.req_ids):
                self._cached_request(cached, i, rid, so, pending)
        for rid, (req, ids) in self.unfinished.items():
            if rid in scheduled_new or rid in cached.req_ids:
                continue
            spec = self.load_specs.pop(rid, None)
            if spec is None or not spec.can_load:
                continue
            meta.loads.append(LoadJob(rid, ids, list(req.block_hashes), spec.local, spec.hit,
                                      spec.tail_keys))
            self.metrics.loads_emitted += 1
        state = getattr(so, "kv_connector_block_state", None)
        if saves and state is not None and state.boundary_state_offloads:
            self._attach_offloads(state.boundary_state_offloads, pending)
        if pending:
            if state is None:
                raise AssertionError("store jobs need SchedulerOutput.kv_connector_block_state")
            for s in pending:
                table = state.get_block_ids(s.req_id)
                if table is None:
                    raise AssertionError(f"no current block table for store request {s.req_id}")
                s.block_ids = tuple(list(table[g]) for g in self.geom.core_group_ids)
        pending.extend(self.finished_tails.values())
        self.finished_tails.clear()
        for s in pending:
            meta.stores.append(self._pin(s))
        return meta

    def _new_request(self, nr: Any, so: Any, pending: list[_Save], saves: bool) -> None:
        rid = nr.req_id
        spec = self.load_specs.pop(rid, None)
        req = self.unfinished[rid][0]
        prefill = nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids
        t = Tracker(
            token_len=nr.num_computed_tokens + so.num_scheduled_tokens[rid],
            block_ids=tuple(list(nr.block_ids[g]) for g in self.geom.core_group_ids),
            prefill_end=len(prefill),
        )
        self.trackers[rid] = t
        loading = spec is not None and spec.can_load
        self._maybe_save(t, req, pending, skip=not saves or loading)

    def _cached_request(self, cached: Any, i: int, rid: str, so: Any, pending: list[_Save]) -> None:
        new_ids = cached.new_block_ids[i]
        if new_ids:
            new_ids = tuple(list(new_ids[g]) for g in self.geom.core_group_ids)
        req = self.unfinished[rid][0] if rid in self.unfinished else None
        if rid in cached.resumed_req_ids:
            if not new_ids or req is None:
                return
            self.load_specs.pop(rid, None)
            t = Tracker(
                token_len=req.num_computed_tokens + so.num_scheduled_tokens[rid],
                block_ids=new_ids,
                prefill_end=len(req.all_token_ids),
            )
            self.trackers[rid] = t
            self._maybe_save(t, req, pending, skip=False)
            return
        t = self.trackers[rid]
        if cached.num_computed_tokens[i] >= t.prefill_end:
            return  # decode: KV past the prefill is never saved
        if req is None:
            raise ValueError(f"request {rid} is not tracked by the connector")
        n = so.num_scheduled_tokens[rid]
        t.token_len += len(req.all_token_ids[t.token_len : t.token_len + n])
        if new_ids:
            for mirror, extra in zip(t.block_ids, new_ids, strict=True):
                mirror.extend(extra)
        self._maybe_save(t, req, pending, skip=False)

    def _maybe_save(self, t: Tracker, req: Any, pending: list[_Save], skip: bool) -> None:
        """Mooncake's ``ReqMeta.from_request_tracker`` save decision."""
        lcm = self.geom.lcm_block_size
        to_save = t.token_len // lcm * lcm
        boundary = cdiv(t.num_saved + 1, lcm) * lcm
        prompt = req.num_prompt_tokens
        publish = self.geom.partial_hits and not t.tail_sent and 0 < prompt <= t.token_len
        if skip or (to_save < boundary and not publish):
            return
        t.num_saved = to_save
        t.tail_sent |= publish
        pending.append(_Save(req.request_id, to_save, t.token_len, prompt, t.block_ids,
                             list(req.block_hashes), publish_tail=publish))

    def _attach_offloads(
        self, offloads: dict[str, list[tuple[int, int, int]]], pending: list[_Save]
    ) -> None:
        """Claim the core's exact Mamba boundary states for this step's store jobs."""
        by_req = {s.req_id: s for s in pending}
        for rid, entries in offloads.items():
            t = self.trackers.get(rid)
            ent = self.unfinished.get(rid)
            if t is None or ent is None:
                self.metrics.offloads_dropped += len(entries)
                continue
            accepted = self._accept(entries, t.prefill_end)
            if not accepted:
                continue
            if (s := by_req.get(rid)) is not None:
                s.boundary_puts = accepted
                continue
            req = ent[0]
            s = _Save(rid, 0, t.token_len, req.num_prompt_tokens, t.block_ids,
                      list(req.block_hashes), boundary_puts=accepted)
            pending.append(s)
            by_req[rid] = s

    def _accept(self, entries: Iterable[tuple[int, int, int]], prefill_end: int) -> list[BoundaryPut]:
        out: list[BoundaryPut] = []
        for core_group, block_id, boundary in entries:
            g = self.geom.store_index(core_group)
            if boundary > prefill_end or block_id == NULL_BLOCK_ID or g is None:
                self.metrics.offloads_dropped += 1
                continue
            if not self.geom.is_mamba[g]:
                self.metrics.offloads_dropped += 1
                continue
            out.append(BoundaryPut(g, block_id, boundary))
        return out

    def tail_puts(self, s: _Save) -> list[BoundaryPut]:
        """Attention blocks of the prompt's partial tail (Mooncake's
        ``_partial_tail_non_mamba_puts``): ``[floor(ck, lcm), ck + margin)`` per group."""
        geom = self.geom
        h = geom.hash_block_size
        mamba_tails = [
            p.num_tokens for p in s.boundary_puts
            if geom.is_mamba[p.group] and p.num_tokens % geom.block_sizes[p.group]
        ]
        if not mamba_tails and not s.publish_tail:
            return []
        boundary = int(checkpoint_position(s.num_prompt_tokens, h, geom.use_eagle))
        if not s.publish_tail and boundary not in mamba_tails:
            return []
        if boundary == 0 or boundary // h > len(s.block_hashes):
            return []
        puts: list[BoundaryPut] = []
        for g, bs in enumerate(geom.block_sizes):
            if geom.is_mamba[g]:
                continue
            proof_end = boundary + geom.proof_margin(g)
            if proof_end > s.completed or proof_end // h > len(s.block_hashes):
                continue
            first, end = tail_put_range(boundary, geom.lcm_block_size, bs, geom.proof_margin(g))
            table = s.block_ids[g]
            for idx in range(first, end):
                if idx >= len(table):
                    break
                if table[idx] == NULL_BLOCK_ID:
                    continue
                puts.append(BoundaryPut(g, table[idx], min((idx + 1) * bs, proof_end)))
        return puts

    def _pin(self, s: _Save) -> StoreJob:
        """Assign a job id and take one GPU reference per distinct block the job may read."""
        if s.job_id is None:
            if tail := self.tail_puts(s):
                s.boundary_puts = [*tail, *s.boundary_puts]
            ids = [p.block_id for p in s.boundary_puts]
            if s.token_len:
                # A rank resumes from its own saved offset: pin every stored non-Mamba block.
                ids.extend(
                    b for g, table in enumerate(s.block_ids) if not self.geom.is_mamba[g]
                    for b in table if b != NULL_BLOCK_ID
                )
            s.job_id = self._take_pins(ids)
        return StoreJob(s.job_id, s.req_id, s.token_len, s.block_ids, s.block_hashes,
                        list(s.boundary_puts))

    def _take_pins(self, ids: list[int]) -> int:
        if NULL_BLOCK_ID in ids:
            raise AssertionError("a null block can never back a store job")
        job = self.next_job_id
        self.next_job_id += 1
        ids = list(dict.fromkeys(ids))
        if ids:
            if self.pool is None:
                raise AssertionError("GPU block pool must be bound before a store job")
            self.pinned[job] = (ids, self.num_workers)
            self.pool.touch([self.pool.blocks[b] for b in ids])
            self.metrics.pinned_blocks += len(ids)
        self.metrics.jobs_emitted += 1
        return job

    # ------------------------------------------------------------------ finish / output

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...],
        offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Pin a finishing request's tail source now (while it still owns the blocks) and
        emit its store job with the next metadata. Never delays the request's free."""
        if not self.settings.saves or not offloads:
            return False
        rid = request.request_id
        t = self.trackers.get(rid)
        if t is None or not any(block_ids):
            return False
        boundaries = {b for _, _, b in offloads}
        if len(boundaries) != 1:
            raise ValueError("partial-tail offloads of one request must share a boundary")
        boundary = next(iter(boundaries))
        if boundary > t.prefill_end:
            return False
        mamba: list[BoundaryPut] = []
        for core_group, block_id, b in offloads:
            g = self.geom.store_index(core_group)
            if g is None or not self.geom.is_mamba[g] or block_id == NULL_BLOCK_ID:
                return False
            mamba.append(BoundaryPut(g, block_id, b))
        s = _Save(rid, 0, request.num_computed_tokens, request.num_prompt_tokens,
                  tuple(list(block_ids[g]) for g in self.geom.core_group_ids),
                  list(request.block_hashes), boundary_puts=mamba)
        s.boundary_puts = [*self.tail_puts(s), *mamba]
        if rid in self.finished_tails:
            raise AssertionError(f"{rid}: second finish-time hand-off")
        s.job_id = self._take_pins([p.block_id for p in s.boundary_puts])
        self.finished_tails[rid] = s
        return False

    def update_connector_output(self, worker_meta: Any) -> None:
        """Release the pins of every store job all workers have finished (exactly once)."""
        if not isinstance(worker_meta, TailproofWorkerMeta):
            return
        for job, count in worker_meta.completed_jobs.items():
            entry = self.pinned.get(job)
            if entry is None:
                continue  # a job that pinned nothing
            ids, left = entry
            left -= count
            if left > 0:
                self.pinned[job] = (ids, left)
                continue
            if left < 0:
                raise AssertionError(f"store job {job} reported by too many workers")
            del self.pinned[job]
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(ids))
            self.metrics.pinned_blocks -= len(ids)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a store job still holds block references."""
        return bool(self.pinned)

    def reset(self) -> None:
        """Forget pending loads (the store is being emptied); pins stay with their jobs."""
        self.load_specs.clear()
