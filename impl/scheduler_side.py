"""Scheduler role: lookups, load specs, store jobs, pins.
One module (over 600 lines) because it mirrors one vLLM class, ``MooncakeStoreScheduler``,
method for method; the reuse extension is a collaborator (``extension``).

Semantics: ``tailproof.reference.connector.scheduler`` (and ``.meta``, ``.tail``). Mirrors vLLM
0.33's ``MooncakeStoreScheduler`` (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``register_finished_partial_tail``, ``update_connector_output``),
restated over plain ints and the boundary arithmetic of ``tailproof.spec.arithmetic``.
Written independently of ``tailproof.reference.connector.scheduler`` on purpose (not shared):
the corpus compares the two op by op, and both with vLLM's own code on ``vllm-mooncake``;
a shared body would compare a function with itself. Pure arithmetic is shared instead
(``spec.arithmetic``). The rules:

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
* re-admission (not vLLM 0.33, whose ``MooncakeStoreScheduler.build_connector_meta`` drops the
  load): a request allocated (``update_state_after_alloc``) since the last meta and reported
  preempted in this one was preempted *before* this ``schedule()`` -- by
  ``Scheduler.reset_prefix_cache(reset_running_requests=True)``, since ``schedule()`` admits no
  waiting request in a step that preempted -- so the preemption retires only its older state
  (tracker, snapshot slots); the admission's load spec and entry stand and its load is issued
  (else it waits in ``WAITING_FOR_REMOTE_KVS`` forever);
* a store job is a :class:`~tailproof.impl.meta.SaveDraft` while ``build_connector_meta``
  assembles it; :meth:`SchedulerSide.seal` makes the frozen ``StoreJob`` (tail and decode
  puts, pins, id, key epoch), the only place one is made. Every block a job may read is
  pinned (``block_pool.touch``) there and released exactly once, when every worker reported
  the job; so requests never delay their own free (``request_finished_all_groups`` answers
  ``(False, None)``). A finish-time job is sealed at finish, with that moment's epoch;
* reuse extension (``docs/reuse.md``, ``docs/junctions.md``; off by default, not vLLM 0.33):
  a collaborator, ``extension.ReuseExtension`` (turn-end checkpoints, decode-time block
  boundaries, lookup wait, junction checkpoints), called at named points marked ``EXTENSION``
  and sharing no state with this class, as ``reference.connector.turn_end`` / ``.junctions``
  are collaborators of the reference scheduler. With the settings leaving it off the
  collaborator is ``extension.NoExtension``, whose every point does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.extension import make_extension
from tailproof.impl.keys import KeyEpoch
from tailproof.impl.lookup import StoreLookup
from tailproof.impl.meta import (
    BoundaryPut,
    LoadJob,
    SaveDraft,
    StoreJob,
    TailKeyBoundary,
    TailproofMeta,
    TailproofWorkerMeta,
)
from tailproof.impl.metrics import SchedulerMetrics
from tailproof.impl.vllm_release import (
    RESUMED_ROWS,
    decode_checkpoints,
    preempted_tracker_dropped,
)
from tailproof.spec.arithmetic import NULL_BLOCK_ID, checkpoint_position, partial_tail_puts

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LoadSpec:
    """A pending external hit (``data.LoadSpec``): ``vllm_cached_tokens`` computed locally,
    ``kvpool_cached_tokens`` in the store."""

    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    can_load: bool = False
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


@dataclass(kw_only=True)
class RequestTracker:
    """Per running request: what has been computed and saved (``data.RequestTracker``;
    restated, not imported, from ``reference.connector.meta`` like the rest of this module)."""

    req_id: str
    token_len: int
    allocated_block_ids: tuple[list[int], ...]  # append-only mirror (offload-only jobs)
    prefill_end_tokens: int = 0  # prompt length, or prompt + outputs for a resumed request
    num_saved_tokens: int = 0
    partial_tail_sent: bool = False
    # ``readable_pins``: (job id, offset) -- every rank reported, after that job of this
    # tracker's generation, a saved offset >= offset; -1: no report yet. ``generation`` counts
    # resets (the request's preemption generation, as the spec's ``Req.generation``), so a job
    # of an earlier generation (reported after a preemption) never confirms anything.
    confirmed: tuple[int, int] = (-1, 0)
    generation: int = 0

    def reset(self) -> None:
        """``RequestTracker.reset`` on preemption: everything zeroed (a rank's saved offset is
        dropped with it, ``close_ended_store_requests``)."""
        self.token_len = 0
        self.allocated_block_ids = ()
        self.num_saved_tokens = 0
        self.prefill_end_tokens = 0
        self.partial_tail_sent = False
        self.confirmed = (-1, 0)
        self.generation += 1


class SchedulerSide:
    """The connector's scheduler role (one per engine); the reuse extension is its collaborator
    :attr:`ext` (module docstring)."""

    def __init__(
        self, settings: Settings, geo: StoreGeometry, lookup: StoreLookup | None,
        num_workers: int, metrics: SchedulerMetrics | None = None,
    ):
        self.settings = settings
        self.geo = geo
        self.lookup_client = lookup
        self.num_workers = num_workers
        self.metrics = metrics or SchedulerMetrics()
        self.pool: Any = None
        # The key epoch (``keys.KeySpace``): every load and store job is stamped with the epoch
        # its KV belongs to; a prefix-cache reset moves it (:meth:`move_epoch`). This role owns
        # it; its lookup client reads the same object.
        self.key_epoch = lookup.key_epoch if isinstance(lookup, StoreLookup) else KeyEpoch()
        self.next_store_job_id = 0
        self.held: dict[int, tuple[list[int], int]] = {}  # job -> (block ids, ranks left)
        self._held_blocks: dict[int, list[Any]] = {}  # job -> its pinned pool blocks, in order
        # ``readable_pins``: pinned normal-save job -> [its tracker, the tracker's generation, the
        # lowest saved offset the ranks reported so far (None: none yet)].
        self._save_jobs: dict[int, list[Any]] = {}
        self._readable = settings.readable_pins
        self._pin_budget: int | None = None  # blocks; set when the pool is bound
        self._earlier_pins = 0  # blocks pinned when this step's meta began (earlier jobs)
        self.load_specs: dict[str, LoadSpec] = {}
        self.request_trackers: dict[str, RequestTracker] = {}
        self.unfinished_requests: dict[str, tuple[Any, tuple[list[int], ...]]] = {}
        self.finished_partial_tails: dict[str, StoreJob] = {}
        # Requests whose load failed: recomputed, never offered the store again (else a store
        # that answers `exists` but fails `get` would make vLLM retry the load forever).
        self.load_failed: set[str] = set()
        # Requests whose load spec came from a remembered lookup (lookup.py): a failed load of
        # one is a remembered key the store no longer held (counted, then recomputed).
        self.remembered_loads: set[str] = set()
        # Requests allocated (``update_state_after_alloc``) since the last meta: one of them
        # reported preempted in that meta was preempted before this schedule() (rule below).
        self.admitted: set[str] = set()
        self._eagle_margins = tuple(geo.eagle_proof_margin(g) for g in range(geo.num_groups))
        self._checkpoints: dict[int, int] = {}  # prompt length -> ck(P) (partial_tail_puts)
        # read on every lookup (settings and geometry are fixed for the connector's life)
        self._lookups, self._alignment = settings.enable_lookup, geo.alignment
        self._lcm = geo.scheduler_block_size
        self._mamba_index = {c: g for g, c in enumerate(geo.core_group_ids) if geo.is_mamba[g]}
        self._consumer = settings.is_consumer
        # vllm_release: a preempted request's tracker is dropped (0.34) or reset (0.33);
        # ``save_decode_cache`` stores decode-time Mamba checkpoints (0.34, vllm#56972 fixed).
        self._drop_preempted = preempted_tracker_dropped()
        self._decode_checkpoints = settings.save_decode_cache and decode_checkpoints()
        # EXTENSION (extension.py): NoExtension unless the settings turn a part of it on; the
        # step and job points of one whose ``steps`` is false are not called.
        self.ext = make_extension(settings, geo, self.metrics, self.seal)

    # ------------------------------------------------------------------ lookup / alloc

    def bind_gpu_block_pool(self, pool: Any) -> None:
        self.pool = pool
        self.ext.bind_pool(pool)  # EXTENSION: its snapshot blocks come from the same pool
        frac = self.settings.pin_budget_fraction
        if frac is not None:
            self._pin_budget = max(1, int(frac * (len(pool.blocks) - 1)))  # not the null block

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed: int) -> tuple[int | None, bool]:
        """External tokens beyond the (block-aligned) local hit, and whether the load is async;
        with ``junction_checkpoints``, also its store-side junction (docs/junctions.md)."""
        need, is_async = self._matched(request, num_computed)
        if need is not None:
            self.ext.after_lookup(request, num_computed + need)  # EXTENSION: junction rule 1
        return need, is_async

    def may_load_async(self, request: Any) -> bool:
        """Whether ``get_num_new_matched_tokens`` can answer this request with an asynchronous
        load: loads are asynchronous, lookups are on, and the store holds a prefix of it.

        vLLM 0.34 asks it in ``Scheduler._enqueue_waiting_request`` under
        ``--max-num-inflight-kv-loads`` (``KVConnectorBase_V1.may_load_async``) to queue the
        request where a load may start while the batch is full. The store is asked through
        the remembered lookup (``lookup.py``), so the scheduler's own ask re-probes nothing.
        The device prefix cache is not known here: where it covers the whole store hit the
        answer is a false positive, which vLLM handles (the request waits for a load slot)."""
        client = self.lookup_client
        if (not self.settings.load_async or not self._lookups or client is None
                or request.num_tokens < self._alignment
                or request.request_id in self.load_failed):
            return False
        try:
            if isinstance(client, StoreLookup):
                res = client.lookup(request.num_tokens, request.block_hashes,
                                    request.request_id)
            else:
                res = client.lookup(request.num_tokens, request.block_hashes)
        except Exception:  # as in _matched: a store problem is a miss, never a crash
            logger.exception("store lookup of %s failed; treating it as a miss",
                             request.request_id)
            self.metrics.lookup_errors += 1
            return False
        return res.hit_length > 0

    def _matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        client = self.lookup_client
        if not self._lookups or client is None:
            return 0, False
        rid = request.request_id
        if request.num_tokens < self._alignment or rid in self.load_failed:
            return 0, False
        remembering = isinstance(client, StoreLookup)
        try:
            if remembering:  # remembered between asks (lookup.py)
                res = client.lookup(request.num_tokens, request.block_hashes, rid)
            else:
                res = client.lookup(request.num_tokens, request.block_hashes)
        except Exception:  # a store problem must never take the scheduler down: no hit
            logger.exception("store lookup of %s failed; treating it as a miss",
                             request.request_id)
            self.metrics.lookup_errors += 1
            return 0, False
        if self.ext.lookup_waits(request, res.hit_length, num_computed):  # EXTENSION: rule 7
            self.metrics.c.inc("lookups_deferred")
            return None, False  # vLLM asks again next step (``Scheduler.schedule``: skipped)
        hit = res.hit_length
        self.metrics.record_lookup(request.num_tokens, hit, self._lcm)
        need = hit - num_computed
        if need <= 0:
            return 0, False
        self.load_specs[rid] = LoadSpec(
            vllm_cached_tokens=num_computed, kvpool_cached_tokens=hit,
            tail_key_boundaries=res.tail_key_boundaries)
        if remembering and client.remembered(rid):
            self.remembered_loads.add(rid)
            self.metrics.c.inc("lookups_remembered")
        return need, self.settings.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        if isinstance(self.lookup_client, StoreLookup):
            self.lookup_client.forget(rid)  # admitted: no longer waiting
        self.admitted.add(rid)
        ids: tuple[list[int], ...] = ()
        if num_external > 0:
            ids = tuple(blocks.get_block_ids(group_ids=self.geo.core_group_ids))
        self.unfinished_requests[rid] = (request, ids)
        spec = self.load_specs.get(rid)
        if spec is None:
            return
        if num_external == 0:
            spec.can_load = False
            return
        if num_external != spec.kvpool_cached_tokens - spec.vllm_cached_tokens:
            raise AssertionError(
                f"{rid}: scheduler adopted {num_external} external tokens, lookup offered "
                f"{spec.kvpool_cached_tokens} - {spec.vllm_cached_tokens}"
            )
        spec.can_load = True

    # ------------------------------------------------------------------ per-step meta

    def build_connector_meta(self, so: Any) -> TailproofMeta:
        """Turn one ``SchedulerOutput`` into the workers' loads and sealed store jobs: the
        step's finished and preempted requests are retired, each scheduled request drafts
        its save (and load), the core's hand-offs join the drafts, and each draft is sealed."""
        self._earlier_pins = self.metrics.pinned_blocks  # the pin budget's backlog
        if so.finished_req_ids:
            self._forget_finished(so.finished_req_ids)
        preempted = set(so.preempted_req_ids or ())
        if preempted:
            self._retire_preempted(preempted)
        self.admitted.clear()
        meta = TailproofMeta(preempted_req_ids=preempted,
                             finished_req_ids=set(so.finished_req_ids))
        if self.ext.steps:
            self.ext.begin_step(so, self.unfinished_requests)  # EXTENSION: the step's ends
        pending: list[SaveDraft] = []
        for nr in so.scheduled_new_reqs:
            self._new_request(nr, so, pending, not self._consumer, meta)
        cached = so.scheduled_cached_reqs
        if not self._consumer or self.settings.save_decode_cache:
            self._cached_requests(cached, so, pending, meta)
        if self.load_specs:  # asynchronous loads of requests not scheduled this step
            scheduled = {r.req_id for r in so.scheduled_new_reqs}
            self._async_loads(scheduled.union(cached.req_ids), meta)
        state = getattr(so, "kv_connector_block_state", None)
        if ((not self._consumer or self._decode_checkpoints) and state is not None
                and state.boundary_state_offloads):
            self._handle_boundary_state_offloads(state.boundary_state_offloads, pending)
        if pending and not self.geo.tables_append_only:
            self._read_current_tables(pending, state)
        stores = meta.stores
        for d in pending:
            if (job := self.seal(d)) is not None:
                stores.append(job)
        # Finish-time jobs were sealed at finish, with that moment's epoch (a reset in between
        # must not publish their KV under the new one).
        if self.finished_partial_tails:
            stores.extend(self.finished_partial_tails.values())
            self.finished_partial_tails.clear()
        # EXTENSION: rule 3's jobs sealed at finish, then rules 1 and 3b, junction rule 2
        if self.ext.steps:  # EXTENSION
            self.ext.end_step(state, meta, self.unfinished_requests, self.request_trackers)
        return meta

    def _forget_finished(self, finished: Iterable[str]) -> None:
        """Finished (or aborted) requests: every trace of them goes."""
        memo = self.lookup_client if isinstance(self.lookup_client, StoreLookup) else None
        for rid in sorted(finished):
            if memo is not None:
                memo.forget(rid)  # finished or aborted while waiting
            self.ext.forget(rid)  # EXTENSION
            self.load_failed.discard(rid)
            self.remembered_loads.discard(rid)
            self.load_specs.pop(rid, None)
            self.request_trackers.pop(rid, None)
            self.unfinished_requests.pop(rid, None)

    def _retire_preempted(self, preempted: set[str]) -> None:
        """Preempted requests: the tracker reset (0.33) or dropped (0.34); the load spec and
        entry go, unless the request was re-admitted in this same step (module docstring)."""
        for rid in sorted(preempted):  # sorted: slots return to the pool in a fixed order
            self.ext.preempted(rid, rid in self.admitted)  # EXTENSION: rule 4
            if self._drop_preempted:
                self.request_trackers.pop(rid, None)
            elif (t := self.request_trackers.get(rid)) is not None:
                t.reset()
            if rid in self.admitted:
                # Preempted before this schedule() and re-admitted by it (module
                # docstring, "re-admission"): the admission's load spec and entry stand.
                self.metrics.c.inc("readmitted_after_preemption")
                continue
            self.load_specs.pop(rid, None)
            self.unfinished_requests.pop(rid, None)

    def _cached_requests(self, cached: Any, so: Any, pending: list[SaveDraft],
                         meta: TailproofMeta) -> None:
        """The ``CachedRequestData`` rows: a decode step only extends the table mirror (the
        common case, kept cheap); the others go through ``_cached_request``."""
        skip_decode = not self.settings.save_decode_cache
        trackers, resumed, computed = (self.request_trackers, getattr(cached, RESUMED_ROWS, ()),
                                       cached.num_computed_tokens)
        new_ids = cached.new_block_ids
        for i, rid in enumerate(cached.req_ids):
            if (skip_decode and rid not in resumed
                    and computed[i] >= trackers[rid].prefill_end_tokens):
                # decode step: nothing to save; a new block still joins the mirror, which
                # later jobs read as the current table
                if new_ids[i]:
                    self._extend_mirror(trackers[rid], new_ids[i])
                continue
            self._cached_request(cached, i, rid, so, pending, meta)

    def _read_current_tables(self, pending: list[SaveDraft], state: Any) -> None:
        """MooncakeStoreScheduler._apply_current_save_block_ids: a window or Mamba group's
        mirror is stale, so the drafts read the core's current tables (fresh lists). With only
        full-attention groups besides Mamba, the mirror is the current table of every group a
        job reads (Mamba states come from hand-offs), and copying the whole table each step
        would make a long prefill quadratic: this is not called then."""
        if state is None:
            raise AssertionError("store jobs need SchedulerOutput.kv_connector_block_state")
        core = self.geo.core_group_ids
        for d in pending:
            table = state.get_block_ids(d.req_id)
            if table is None:
                raise AssertionError(f"no current block table for store request {d.req_id}")
            d.block_ids = tuple([table[g] for g in core])

    def _async_loads(self, scheduled: set[str], meta: TailproofMeta) -> None:
        """``build_connector_meta``'s loads for requests waiting on them (MS:304-525)."""
        load_specs = self.load_specs
        for rid, (req, ids) in self.unfinished_requests.items():
            if rid in scheduled or rid not in load_specs:
                continue
            spec = load_specs.pop(rid)
            if spec is None or not spec.can_load:
                continue
            meta.loads.append(self._load_job(rid, ids, req, spec, is_async=True))
            self.metrics.loads_emitted += 1

    def _new_request(self, nr: Any, so: Any, pending: list[SaveDraft], saves: bool,
                     meta: TailproofMeta) -> None:
        rid = nr.req_id
        spec = self.load_specs.pop(rid, None)
        req = self.unfinished_requests[rid][0]
        prefill = nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids
        t = RequestTracker(
            req_id=rid,
            token_len=nr.num_computed_tokens + so.num_scheduled_tokens[rid],
            allocated_block_ids=tuple([list(nr.block_ids[g]) for g in self.geo.core_group_ids]),
            prefill_end_tokens=len(prefill),
        )
        self.request_trackers[rid] = t
        loading = spec is not None and spec.can_load
        if loading:
            self._sync_load(meta, rid, req, t.allocated_block_ids, spec)
        self._maybe_save(t, req, pending, skip=not saves or loading)

    def _sync_load(self, meta: TailproofMeta, rid: str, req: Any,
                   ids: tuple[list[int], ...], spec: LoadSpec | None) -> None:
        """A load feeding this step's forward (``load_async`` off)."""
        assert spec is not None
        meta.loads.append(self._load_job(rid, tuple([list(g) for g in ids]), req, spec,
                                         is_async=False))
        self.metrics.loads_emitted += 1

    def _load_job(self, rid: str, ids: tuple[list[int], ...], req: Any, spec: LoadSpec,
                  is_async: bool) -> LoadJob:
        return LoadJob(req_id=rid, block_ids=ids, block_hashes=list(req.block_hashes),
                       vllm_cached_tokens=spec.vllm_cached_tokens,
                       kvpool_cached_tokens=spec.kvpool_cached_tokens,
                       tail_key_boundaries=spec.tail_key_boundaries, is_async=is_async,
                       epoch=self.key_epoch.value)

    def _cached_request(self, cached: Any, i: int, rid: str, so: Any, pending: list[SaveDraft],
                        meta: TailproofMeta) -> None:
        resumed = rid in getattr(cached, RESUMED_ROWS, ())  # 0.33 Model Runner V1 only
        core_ids = cached.new_block_ids[i]  # the core's lists, per core group
        if not resumed:
            t = self.request_trackers[rid]
            decode = cached.num_computed_tokens[i] >= t.prefill_end_tokens
            if decode and not self.settings.save_decode_cache:
                if core_ids:
                    self._extend_mirror(t, core_ids)
                return  # decode: KV past the prefill is not saved (the common, cheap path)
        ent = self.unfinished_requests.get(rid)
        req = ent[0] if ent is not None else None
        if resumed:
            if not core_ids or req is None:
                return
            # the resumed request's new mirror (copies: the mirror is appended to)
            new_ids = tuple([list(core_ids[g]) for g in self.geo.core_group_ids])
            spec = self.load_specs.pop(rid, None)
            t = RequestTracker(
                req_id=rid,
                token_len=req.num_computed_tokens + so.num_scheduled_tokens[rid],
                allocated_block_ids=new_ids,
                prefill_end_tokens=len(req.all_token_ids),
            )
            self.request_trackers[rid] = t
            loading = spec is not None and spec.can_load
            if loading:
                self._sync_load(meta, rid, req, new_ids, spec)
            self._maybe_save(t, req, pending, skip=loading or self._consumer)
            return
        if req is None:
            raise ValueError(f"request {rid} is not tracked by the connector")
        # Real tokens only: scheduled speculative drafts are not part of the sequence yet.
        avail = req.num_tokens - t.token_len
        t.token_len += max(0, min(so.num_scheduled_tokens[rid], avail))
        if core_ids:
            self._extend_mirror(t, core_ids)
        if self._consumer and not decode:
            return  # a consumer saves decode KV only
        self._maybe_save(t, req, pending, skip=False)

    def _extend_mirror(self, t: RequestTracker, core_ids: Any) -> None:
        """Append a step's new blocks to the request's table mirror, per core group. Every
        step's, decode steps' too: with ``tables_append_only`` jobs read the mirror as the
        current table (rule 5's decode-boundary attention puts among them)."""
        for mirror, g in zip(t.allocated_block_ids, self.geo.core_group_ids, strict=True):
            mirror.extend(core_ids[g])

    def _maybe_save(self, t: RequestTracker, req: Any, pending: list[SaveDraft],
                    skip: bool) -> None:
        """Mooncake's ``ReqMeta.from_request_tracker`` save decision."""
        lcm = self.geo.scheduler_block_size
        to_save = t.token_len // lcm * lcm
        boundary = -(-(t.num_saved_tokens + 1) // lcm) * lcm  # cdiv on ints (hot path)
        prompt = req.num_prompt_tokens
        publish = self.geo.partial_hits and not t.partial_tail_sent and 0 < prompt <= t.token_len
        if skip or (to_save < boundary and not publish):
            return
        start, t.num_saved_tokens = t.num_saved_tokens, to_save
        t.partial_tail_sent |= publish
        pending.append(SaveDraft(
            req_id=req.request_id, token_len_chunk=to_save, block_ids=t.allocated_block_ids,
            block_hashes=req.block_hashes, token_ids_start=start, publish_partial_tail=publish,
            completed_token_len=t.token_len, num_prompt_tokens=prompt,
            prefill_end_tokens=t.prefill_end_tokens))

    def _handle_boundary_state_offloads(
        self, offloads: dict[str, list[tuple[int, int, int]]], pending: list[SaveDraft]
    ) -> None:
        """Claim the core's exact Mamba boundary states for this step's store jobs."""
        by_req = {s.req_id: s for s in pending}
        for rid, entries in offloads.items():
            t = self.request_trackers.get(rid)
            ent = self.unfinished_requests.get(rid)
            if t is None or ent is None:
                self.metrics.offloads_dropped += len(entries)
                continue
            end = t.prefill_end_tokens
            accepted = self._accept(entries, end)
            if not accepted:
                continue
            # EXTENSION: rule 5's attention puts, unless vLLM's decode saves store that KV
            rule5 = self.ext.decode_saves and not self.settings.native_decode_boundaries
            decode = sorted({p.num_tokens for p in accepted if p.num_tokens > end}) if rule5 \
                else []
            if (s := by_req.get(rid)) is not None:
                s.boundary_puts = accepted
                s.decode_boundaries = decode
                continue
            req = ent[0]
            completed = self.ext.step_end(rid, t.token_len) if decode else t.token_len
            s = SaveDraft(req_id=rid, token_len_chunk=0, block_ids=t.allocated_block_ids,
                         block_hashes=req.block_hashes, boundary_puts=accepted,
                         completed_token_len=completed,
                         num_prompt_tokens=req.num_prompt_tokens, decode_boundaries=decode)
            pending.append(s)
            by_req[rid] = s

    def _accept(
        self, entries: Iterable[tuple[int, int, int]], prefill_end_tokens: int
    ) -> list[BoundaryPut]:
        """The hand-offs a producer stores: Mamba groups, non-null, at or below the prefill end
        -- or past it too with ``decode_boundary_saves`` (rule 5; vLLM 0.33 drops those) or
        0.34's decode checkpoints (``save_decode_cache``), the only ones a consumer stores."""
        out: list[BoundaryPut] = []
        decode_ok = self.ext.decode_saves or self._decode_checkpoints  # EXTENSION: rule 5
        mamba_index = self._mamba_index
        consumer = self._consumer
        for core_group, block_id, boundary in entries:
            g = mamba_index.get(core_group)  # None: not stored, or not a Mamba group
            past = boundary > prefill_end_tokens
            if (past and not decode_ok or consumer and not past or block_id == NULL_BLOCK_ID
                    or g is None):
                self.metrics.offloads_dropped += 1
                continue
            out.append(BoundaryPut(g, block_id, boundary))
        return out

    def partial_tail_puts(self, s: SaveDraft) -> list[BoundaryPut]:
        """Attention blocks of the prompt's partial tail (``spec.arithmetic.partial_tail_puts``,
        Mooncake's ``_partial_tail_non_mamba_puts``): ``[floor(ck, lcm), ck + margin)`` per
        group."""
        if not s.publish_partial_tail and not s.boundary_puts:
            return []  # a plain normal save (the common case)
        geo = self.geo
        mamba, sizes = geo.is_mamba, geo.block_sizes
        mamba_tails = [p.num_tokens for p in s.boundary_puts
                       if mamba[p.group_id] and p.num_tokens % sizes[p.group_id]]
        if not s.publish_partial_tail and (
                not mamba_tails or self._checkpoint(s.num_prompt_tokens) not in mamba_tails):
            return []  # the spec's own early exit, with ck(P) remembered: a junction hand-off
        puts = partial_tail_puts(
            num_prompt_tokens=s.num_prompt_tokens, completed_token_len=s.completed_token_len,
            num_hashes=len(s.block_hashes), publish_partial_tail=s.publish_partial_tail,
            mamba_tail_boundaries=mamba_tails, block_ids=s.block_ids,
            block_sizes=geo.block_sizes, is_mamba=geo.is_mamba,
            eagle_margins=self._eagle_margins, hash_block_size=geo.hash_block_size,
            scheduler_block_size=geo.scheduler_block_size, use_eagle=geo.use_eagle)
        return [BoundaryPut(*p) for p in puts]

    def _checkpoint(self, num_prompt_tokens: int) -> int:
        """ck(P) (``spec.arithmetic.checkpoint_position``), remembered per prompt length."""
        ck = self._checkpoints.get(num_prompt_tokens)
        if ck is None:
            if len(self._checkpoints) > 4096:
                self._checkpoints.clear()
            ck = self._checkpoints[num_prompt_tokens] = int(checkpoint_position(
                num_prompt_tokens, self.geo.hash_block_size, self.geo.use_eagle))
        return ck

    def seal(self, d: SaveDraft, *, budgeted: bool = True) -> StoreJob | None:
        """The one place a :class:`StoreJob` is made: the draft's boundary puts get the
        attention puts of its decode boundaries (rule 5) and of the prompt's partial tail in
        front; one GPU reference is taken per distinct block the job may read (the puts, and
        the normal save's table from the pin floor); the job gets the next id and the current
        key epoch. None: the pins would pass the pin budget, no id is taken and the draft is
        dropped. ``budgeted=False``: a checkpoint job of the reuse extension, which the budget
        never skips (as in the reference, ``_pin_extension_job``)."""
        puts = d.boundary_puts
        if d.decode_boundaries:  # EXTENSION: rule 5
            puts = [*self.ext.decode_boundary_puts(d, self.request_trackers.get(d.req_id)),
                    *puts]
        if tail := self.partial_tail_puts(d):
            puts = [*tail, *puts]
        ids = [p.block_id for p in puts]
        if NULL_BLOCK_ID in ids:
            raise AssertionError("a null block can never back a boundary put")
        if len(ids) > 1:
            ids = list(dict.fromkeys(ids))
        t = None
        floor = 0
        if d.token_len_chunk:
            t = self.request_trackers.get(d.req_id) if self._readable else None
            table, floor = self._save_pins(d, t)
            if NULL_BLOCK_ID in table:  # null table entries are never read
                table = [b for b in table if b != NULL_BLOCK_ID]
            if tail or d.decode_boundaries:
                # an attention tail put's block may be in the table too: one reference per
                # block (a Mamba state block never is: it belongs to its own group's table)
                ids = list(dict.fromkeys(ids + table))
            else:
                ids += table
        job_id = self._pins_within_budget(ids) if budgeted else self._take_pins(ids)
        if job_id is None:
            return None
        # Positional, in StoreJob's field order (half the cost of keywords on this hot path;
        # test_pin_rules checks every field).
        job = StoreJob(job_id, d.req_id, d.token_len_chunk, d.block_ids, d.block_hashes,
                       tuple(puts), d.token_ids_start, d.publish_partial_tail,
                       d.completed_token_len, d.num_prompt_tokens, d.prefill_end_tokens,
                       self.key_epoch.value, floor)
        pinned = job_id in self.held
        if t is not None and pinned:
            self._save_jobs[job_id] = [t, t.generation, None]
        if self.ext.steps:
            self.ext.job_sealed(job, pinned)  # EXTENSION: rule 7
        return job

    def _save_pins(self, d: SaveDraft, t: RequestTracker | None) -> tuple[list[int], int]:
        """The non-Mamba blocks the normal save of ``d`` may read, and the pin floor. vLLM 0.33
        (``_reference_save_blocks``) pins every one of the table (floor 0): a rank resumes from
        its own saved offset, which lags after a failed or skipped put. With ``readable_pins``
        (t given) only ``[floor, end)``: ``floor`` = the offset every rank reported reaching
        after an earlier job of this tracker's generation (0 before any report), capped at
        ``token_ids_start``. A rank's offset only grows within a generation, its jobs run in
        order, so it resumes at or above ``floor``; the worker reads nothing below the job's
        ``pin_floor``."""
        mamba, sizes = self.geo.is_mamba, self.geo.block_sizes
        if t is None:
            return [b for g, table in enumerate(d.block_ids) if not mamba[g] for b in table], 0
        floor = min(d.token_ids_start, t.confirmed[1])
        end = d.token_len_chunk
        out: list[int] = []
        for g, table in enumerate(d.block_ids):
            if not mamba[g]:
                bs = sizes[g]
                out += table[floor // bs: -(-end // bs)]
        return out, floor

    def _pins_within_budget(self, ids: list[int]) -> int | None:
        """:meth:`_take_pins`, or None (no id taken, counted) when the pins still held by jobs
        of earlier steps (their senders lag) plus this job's would pass the pin budget
        (``pin_budget_fraction``): the job is skipped, a future miss, as after a pressure
        skip (not vLLM 0.33, whose pins are unbounded). While the senders keep up (every job
        reported before the next step) nothing is skipped, however large a step's saves;
        pins stay within the budget plus one step's jobs."""
        cap, held = self._pin_budget, self._earlier_pins
        if cap is not None and ids and held and held + len(ids) > cap:
            self.metrics.c.inc("jobs_skipped_pin_budget")
            return None
        return self._take_pins(ids)

    def _take_pins(self, ids: list[int]) -> int:
        """A new job id pinning ``ids`` (distinct, non-null) until every worker reported."""
        if NULL_BLOCK_ID in ids:
            raise AssertionError("a null block can never back a store job")
        job = self.next_store_job_id
        self.next_store_job_id += 1
        if ids:
            if self.pool is None:
                raise AssertionError("GPU block pool must be bound before a store job")
            self.held[job] = (ids, self.num_workers)
            blocks = self.pool.blocks
            self._held_blocks[job] = pinned = list(map(blocks.__getitem__, ids))
            self.pool.touch(pinned)
            self.metrics.pinned_blocks += len(ids)
        self.metrics.jobs_emitted += 1
        return job

    # ------------------------------------------------------------------ finish / output

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Pin a finishing request's tail source now (while it still owns the blocks) and
        emit its store job with the next metadata. Never delays the request's free."""
        # Also in reference.connector.scheduler: impl and the reference it is checked against
        # must not share a body (docs/architecture.md); both mirror vLLM 0.33 MS:600-670.
        if self.settings.is_consumer or not partial_tail_offloads:
            return False
        rid = request.request_id
        t = self.request_trackers.get(rid)
        if t is None or not any(block_ids):
            return False
        boundaries = {b for _, _, b in partial_tail_offloads}
        if len(boundaries) != 1:
            raise ValueError("partial-tail offloads of one request must share a boundary")
        boundary = next(iter(boundaries))
        if boundary > t.prefill_end_tokens:
            return False
        mamba: list[BoundaryPut] = []
        for core_group, block_id, b in partial_tail_offloads:
            g = self._mamba_index.get(core_group)  # None: not stored, or not a Mamba group
            if g is None or block_id == NULL_BLOCK_ID:
                return False
            mamba.append(BoundaryPut(g, block_id, b))
        d = SaveDraft(req_id=rid, token_len_chunk=0,
                      block_ids=tuple([list(block_ids[g]) for g in self.geo.core_group_ids]),
                      block_hashes=list(request.block_hashes), boundary_puts=mamba,
                      completed_token_len=request.num_computed_tokens,
                      num_prompt_tokens=request.num_prompt_tokens)
        if rid in self.finished_partial_tails:
            raise AssertionError(f"{rid}: second finish-time hand-off")
        # Sealed now, as a step's job (the attention tail puts, the pins), with this epoch: it
        # is emitted with a later meta, but its KV is this epoch's.
        job = self.seal(d)
        if job is not None:  # None: over the pin budget, the tail is not stored
            self.finished_partial_tails[rid] = job
        return False

    def finish_turn(self, request: Any, block_ids: tuple[list[int], ...]) -> StoreJob | None:
        """EXTENSION, rule 3 (``request_finished_all_groups``, before the core frees the
        request's blocks): the request's turn-end job, sealed now (None: nothing to flush)."""
        return self.ext.finish_turn(request, block_ids,
                                    self.request_trackers.get(request.request_id))

    def update_connector_output(self, worker_meta: Any, failed_recving: Iterable[str] = ()) -> None:
        """Release the pins of every store job all workers have finished (exactly once), and
        remember failed loads (those requests are recomputed without the store)."""
        if failed_recving:
            failed = set(failed_recving)
            self.load_failed.update(failed)
            self.metrics.c.inc("loads_failed", len(failed))
            stale = sum(1 for rid in failed if rid in self.remembered_loads)
            if stale:  # a remembered key the store no longer held: failed closed, recomputed
                self.metrics.c.inc("remembered_hits_failed", stale)
        if not isinstance(worker_meta, TailproofWorkerMeta):
            return
        offsets = worker_meta.saved_offsets
        saves = self._save_jobs
        for job, count in worker_meta.completed_saves.items():
            entry = self.held.get(job)
            if entry is None:
                continue  # a job that pinned nothing
            if (ent := saves.get(job)) is not None:
                off = offsets.get(job, 0)  # a report without offsets confirms nothing
                ent[2] = off if ent[2] is None else min(ent[2], off)
            ids, left = entry
            left -= count
            if left > 0:
                self.held[job] = (ids, left)
                continue
            if left < 0:
                raise AssertionError(f"store job {job} reported by too many workers")
            del self.held[job]
            if ent is not None:
                del saves[job]
                t, generation, off = ent
                if t.generation == generation and job > t.confirmed[0]:
                    t.confirmed = (job, off)
            if self.ext.steps:
                self.ext.job_released(job)  # EXTENSION: rule 7
            self.pool.free_blocks(self._held_blocks.pop(job)[::-1])
            self.metrics.pinned_blocks -= len(ids)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a store job still holds block references."""
        return bool(self.held)

    def reset(self) -> None:
        """Forget pending loads (the store is being emptied); pins stay with their jobs."""
        self.load_specs.clear()

    def reset_refusal(self) -> str | None:
        """Why a prefix-cache reset must fail now (None: it may proceed): a GPU block still in
        use -- vLLM's own condition (``BlockPool.reset_prefix_cache``), which also covers every
        store job's pins -- holds KV computed before the reset, which a later save would
        publish under the new epoch. Without a bound pool: store jobs still pending."""
        pool = self.pool
        if pool is not None:
            used = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # the null block
            if used > 0:
                return f"{used} GPU block(s) still in use"
        pending = (len(self.held) + len(self.finished_partial_tails)
                   + self.ext.pending_jobs())
        if pending:
            return f"{pending} store job(s) still pending"
        return None

    @property
    def epoch(self) -> str:
        """The current key epoch (jobs and loads are stamped with it)."""
        return self.key_epoch.value

    def move_epoch(self, epoch: str) -> None:
        """Move to a fresh key epoch: lookups and jobs built from now on use it (the lookup
        client shares :attr:`key_epoch`)."""
        self.key_epoch.value = epoch
