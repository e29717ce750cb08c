"""Scheduler side of the connector: trackers, store jobs and the GPU block pins they hold.

Mirrors ``MooncakeStoreScheduler`` (MS:135-788). The rules, each with the function it mirrors:

- a normal save covers the lcm floor of the tracked length and is due once that passes the next
  lcm boundary (``ReqMeta.from_request_tracker``, MD:788-865);
- the prompt's partial tail is published once, on the save that first covers the prompt, with
  its attention tail puts (``_partial_tail_non_mamba_puts`` via ``_reference_save_blocks``);
- core boundary hand-offs are claimed only by a producer, only for live requests, only up to
  ``prefill_end_tokens`` (decode boundaries are dropped unpinned; a resumed prefill's
  ``prefill_end_tokens`` covers its replayed outputs), never for null blocks or non-Mamba
  groups (``_handle_boundary_state_offloads``, MS:672-727); on 0.34, with
  ``save_decode_cache``, decode boundaries are claimed too, by a consumer only those
  (``Release.decode_checkpoints``);
- resumed requests are cached rows after the running ones (0.33) or new requests in admission
  order before them (0.34, ``Release.resumed_as_new``);
- every job gets a never-reused id and pins each distinct non-null block it may read once:
  its boundary puts and, for a normal save, every non-Mamba block of the current table
  (``_reference_save_blocks``, MS:550-598);
- pins are released tail-first exactly once, after every worker reported the job
  (``update_connector_output``, MS:729-751); preemption and request-id reuse never release an
  in-flight job, because pins are keyed by job id;
- a finish-time tail is pinned before the request's blocks are freed
  (``register_finished_partial_tail``, MS:600-670).

DEVIATION (not vLLM 0.33; its rule is kept for every other case): vLLM drops a preempted
request's load spec and entry in ``build_connector_meta`` (MS:304-525, the preempted loop).
``Scheduler.reset_prefix_cache(reset_running_requests=True)`` (SC:3184-3226) preempts outside
``schedule()``, and the next ``schedule()`` re-admits those requests -- its "no waiting admissions
in a step that preempted" test (SC:1050) only sees its own preemptions -- with an asynchronous
load, reporting them preempted in the *same* ``SchedulerOutput`` (SC:1733): vLLM's rule then drops
the load it was just given and the request waits in ``WAITING_FOR_REMOTE_KVS`` forever. Here a
request allocated (``update_state_after_alloc``) since the last meta and reported preempted in it
was preempted before that allocation, so its preemption retires only the older state (tracker,
snapshot slots): the admission's load spec, entry and junction stop stand and the load is issued.

DEVIATION, readable pins (``config.connector.readable_pins``; not vLLM 0.33, which keeps its
rule above when off): vLLM pins every non-Mamba block of the table for each normal save, because
a rank resumes from its own saved offset, which lags after a failed, pressure-skipped or
queue-full put (MW:727-1045). That is up to the whole prompt twice a step (touch, then free at
the report) for a long prefill. Here each rank's report also carries its saved offset once the
job was over, and the job pins only ``[floor, token_len_chunk)`` of each non-Mamba table:
``floor`` = the lowest offset all ranks reported after the latest fully reported earlier job of
the request's tracker (its *generation*: a preemption starts a new one, and a job of an earlier
generation never confirms anything), else 0, capped at ``token_ids_start``. Safe because,
within a generation, a rank's offset only grows and its jobs of one request run in order, so it
resumes at or above ``floor``; and the job carries ``pin_floor`` = ``floor``: a rank whose
offset is below it anyway (vLLM's request-id reuse, whose drained finish drops an offset
mid-generation) reads nothing for the normal save and reports its offset, so the next job pins
from there (a miss, never an unpinned read).

DEVIATION, pin budget (``config.connector.pin_budget_fraction``; not vLLM 0.33, whose pins are
unbounded): a job whose pins would take the blocks held by other store jobs (counted per job)
past ``fraction * (pool blocks - 1)`` gets no id and is not emitted (a future miss, as after a
pressure skip: its range is saved by the request's next job, which pins from the ranks'
offsets). What counts is the blocks still pinned when the step's meta began -- jobs of earlier
steps, whose senders lag -- plus the job's own: while every job is reported before the next
step nothing is skipped, however large a step's saves; pins stay within the budget plus one
step's jobs.

``tailproof.impl.scheduler_side`` restates these rules independently on purpose: the corpus
compares the two (and both with vLLM's own code), so neither imports the other.

EXTENSION (not vLLM 0.33, off by default): the turn-end checkpoints and decode-time block
boundaries of ``docs/reuse.md`` live in ``turn_end.py``, the junction checkpoints of
``docs/junctions.md`` in ``junctions.py``; the calls into them below are marked
``# EXTENSION`` and change nothing while ``config.connector`` leaves them off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.junctions import JunctionRequest, Junctions
from tailproof.reference.connector.meta import (
    BoundaryPut,
    LoadSpec,
    RequestTracker,
    StoreJob,
    from_request_tracker,
)
from tailproof.reference.connector.tail import NULL_BLOCK_ID, partial_tail_puts
from tailproof.reference.connector.turn_end import (
    InflightKeys,
    Snapshot,
    TurnEnd,
    decode_boundary_puts,
)
from tailproof.reference.releases import Release, release
from tailproof.spec.arithmetic import cdiv


class RequestLike(Protocol):
    """The live request fields the connector reads (``vllm.v1.request.Request``)."""

    request_id: str
    all_token_ids: Sequence[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: Sequence[bytes]


class PinPool(Protocol):
    """The GPU block pool, by id: ``BlockPool.touch`` / ``BlockPool.free_blocks``, and for the
    extension's snapshot blocks ``BlockPool.get_new_blocks`` / ``get_num_free_blocks``."""

    def touch_ids(self, ids: list[int]) -> None: ...

    def free_ids(self, ids: list[int]) -> None: ...

    def take_ids(self, n: int) -> list[int]: ...

    def num_free(self) -> int: ...


@dataclass
class Scheduled:
    """One request scheduled this step (``NewRequestData`` or a ``CachedRequestData`` row)."""

    request: RequestLike
    num_scheduled: int
    kind: str  # "new" | "resumed" | "running"
    block_ids: tuple[list[int], ...]  # new/resumed: the whole table; running: new blocks
    num_computed_tokens: int  # at schedule time (before this step's tokens)


Offloads = dict[str, list[tuple[int, int, int]]]  # rid -> [(group, block, boundary)]


class ConnectorScheduler:
    def __init__(self, conf: ConnectorConfig, geo: StoreGeometry, pool: PinPool,
                 num_blocks: int | None = None, rules: Release | None = None) -> None:
        self.conf = conf
        self.geo = geo
        self.rules = rules or release(None)  # the vLLM release followed (releases.py)
        self.pool = pool
        self.num_workers = conf.num_workers
        self.next_store_job_id = 0
        # store_job_id -> (block ids, ranks yet to report)
        self.held: dict[int, tuple[list[int], int]] = {}
        # DEVIATION (readable pins): normal-save job -> [tracker, its generation, lowest offset]
        self.save_jobs: dict[int, list] = {}
        self.earlier_pins = 0  # DEVIATION (pin budget): blocks pinned when the step began
        frac = conf.pin_budget_fraction
        self.pin_budget = (None if frac is None or num_blocks is None
                           else max(1, int(frac * (num_blocks - 1))))
        self.load_specs: dict[str, LoadSpec] = {}
        self.request_trackers: dict[str, RequestTracker] = {}
        self.unfinished_requests: dict[str, tuple[RequestLike, tuple[list[int], ...]]] = {}
        self.unfinished_request_ids: set[str] = set()
        self.admitted: set[str] = set()  # allocated since the last meta (DEVIATION above)
        self.finished_partial_tails: dict[str, StoreJob] = {}
        # EXTENSION (docs/reuse.md): snapshot blocks, the step's copies, the turn-end jobs.
        self.turn_end = TurnEnd(conf, geo, pool)
        self.step_snapshots: list[Snapshot] = []
        self.turn_end_jobs: dict[str, StoreJob] = {}
        extension = conf.turn_end_checkpoints or conf.decode_boundary_saves
        extension = extension or conf.junction_checkpoints
        self.inflight = InflightKeys(geo) if extension and conf.checkpoint_lookup_wait else None
        # EXTENSION (docs/junctions.md): the prompt index and the pending junction stops.
        self.junctions = Junctions(conf, geo, pool)

    # --- admission ---------------------------------------------------------------------

    def update_state_after_alloc(self, request: RequestLike, block_ids: tuple[list[int], ...],
                                 num_external: int) -> None:
        """mirrors ``update_state_after_alloc`` (MS:267-302)."""
        rid = request.request_id
        self.admitted.add(rid)
        self.unfinished_requests[rid] = (request, block_ids if num_external > 0 else ())
        self.unfinished_request_ids.add(rid)
        spec = self.load_specs.get(rid)
        if spec is None:
            return
        if num_external == 0:
            spec.can_load = False
            return
        assert num_external == spec.kvpool_cached_tokens - spec.vllm_cached_tokens
        spec.can_load = True

    # --- one scheduler step ------------------------------------------------------------

    def build_connector_meta(
            self, scheduled: list[Scheduled], finished: set[str], preempted: set[str],
            offloads: Offloads, current_table: Callable[[str], tuple[list[int], ...] | None],
    ) -> list[StoreJob]:
        """mirrors ``build_connector_meta`` (MS:304-525); returns the step's metadata rows."""
        conf = self.conf
        is_consumer = conf.is_consumer
        self.earlier_pins = sum(len(pins) for pins, _ in self.held.values())
        self._retire(finished, preempted)
        rows: list[StoreJob] = []
        as_new = ("new", "resumed") if self.rules.resumed_as_new else ("new",)
        new = [s for s in scheduled if s.kind in as_new]  # in admission order
        # 0.33: CachedRequestData lists running requests, then resumed ones (SC:1939).
        cached = [s for s in scheduled if s.kind == "running"]
        cached += [s for s in scheduled if s.kind not in as_new and s.kind != "running"]
        for s in new:
            rows += self._new_request(s, is_consumer)
        can_process_cached = not is_consumer or conf.save_decode_cache
        if can_process_cached:
            for s in cached:
                rows += self._cached_request(s, is_consumer)
        rows += self._unscheduled_loads({s.request.request_id for s in scheduled})
        decode: dict[str, list[int]] = {}
        # 0.33 claims hand-offs for producers only; 0.34 whenever cached rows are processed.
        if offloads and (can_process_cached if self.rules.decode_checkpoints
                         else not is_consumer):
            self._handle_boundary_state_offloads(offloads, rows, decode)
        for job in rows:  # _apply_current_save_block_ids (MS:527-548)
            if job.can_save:
                table = current_table(job.req_id)
                assert table is not None, f"Missing current block table for {job.req_id}"
                job.block_ids = tuple(list(ids) for ids in table)
        if decode:  # EXTENSION rule 5
            self._decode_boundary_puts(rows, decode, scheduled)
        rows.extend(self.finished_partial_tails.values())
        self.finished_partial_tails.clear()
        rows.extend(self.turn_end_jobs.values())  # EXTENSION rule 3: after the partial tails
        self.turn_end_jobs.clear()
        if not conf.capacity_only:
            self._reference_save_blocks(rows)
        # EXTENSION rule 1: after the jobs are pinned, in the order above: new, then running,
        # then resumed (0.33); new and resumed in admission order, then running (0.34).
        self._turn_end_step(new + cached, current_table, rows)
        if self.junctions.targets:  # EXTENSION (junctions): after the turn-end pass
            self._junction_jobs(new + cached, current_table, rows)
        return rows

    def _retire(self, finished: set[str], preempted: set[str]) -> None:
        """The preamble of ``build_connector_meta``: finished requests forgotten, preempted
        ones reset (0.33) or dropped (0.34), their load spec and entry gone unless
        re-admitted in this same step (DEVIATION above)."""
        for rid in sorted(finished):
            self.turn_end.release(rid)  # EXTENSION: finish_turn normally did (then a no-op)
            self.junctions.forget(rid, finished=True)  # EXTENSION (junctions)
            self.load_specs.pop(rid, None)
            self.request_trackers.pop(rid, None)
            self.unfinished_requests.pop(rid, None)
            self.unfinished_request_ids.discard(rid)
        for rid in sorted(preempted):
            self.turn_end.release(rid)  # EXTENSION rule 4
            if self.rules.preempted_tracker_dropped:
                self.request_trackers.pop(rid, None)
            elif (t := self.request_trackers.get(rid)) is not None:
                t.reset()
            if rid in self.admitted:
                continue  # DEVIATION: preempted before this step's re-admission, which stands
            self.junctions.forget(rid, finished=False)  # EXTENSION: re-admission asks again
            self.load_specs.pop(rid, None)
            self.unfinished_requests.pop(rid, None)
        self.admitted.clear()

    def _unscheduled_loads(self, scheduled_ids: set[str]) -> list[StoreJob]:
        """The rows of requests not scheduled this step whose load spec can load (an
        asynchronous load: the request waits for it)."""
        rows: list[StoreJob] = []
        for rid, (req, block_ids) in list(self.unfinished_requests.items()):
            if rid in scheduled_ids:
                continue
            spec = self.load_specs.pop(rid, None)
            if spec is None or not spec.can_load:
                continue
            t = RequestTracker(req_id=rid, token_len=spec.kvpool_cached_tokens,
                               allocated_block_ids=block_ids)
            self.request_trackers[rid] = t
            job = from_request_tracker(t, self.geo.scheduler_block_size, req.block_hashes,
                                       load_spec=spec, skip_save=None,
                                       num_prompt_tokens=req.num_prompt_tokens)
            if job is not None:
                rows.append(job)
        return rows

    def _turn_end_step(self, order: list[Scheduled],
                       current_table: Callable[[str], tuple[list[int], ...] | None],
                       rows: list[StoreJob]) -> None:
        """EXTENSION rules 1 and 3b: the step's snapshots, and the flush of each request whose
        snapshot is its last boundary before a finish by length."""
        h = self.geo.hash_block_size
        self.step_snapshots, final = self.turn_end.take_snapshots(
            [(s.request.request_id, s.num_computed_tokens + s.num_scheduled,
              s.request.num_prompt_tokens, current_table(s.request.request_id),
              TurnEnd.last_boundary(s.request.num_prompt_tokens,
                                    getattr(s.request, "max_tokens", None), h))
             for s in order])
        steps = {s.request.request_id: s for s in order}
        for rid in final:  # EXTENSION rule 3b: the last boundary is flushed in its own step
            t = self.request_trackers.get(rid)
            if t is None:
                continue  # kept until finish, as any snapshot
            s = steps[rid]
            table = current_table(rid)
            assert table is not None
            job = self.turn_end.flush(rid, t, s.num_computed_tokens + s.num_scheduled,
                                      s.request.block_hashes, s.request.num_prompt_tokens,
                                      tuple(list(ids) for ids in table))
            assert job is not None
            self._pin_extension_job(job)
            self.turn_end.release(rid)
            rows.append(job)

    def after_lookup(self, request: JunctionRequest, num_computed: int,
                     need: int | None) -> None:
        """EXTENSION (docs/junctions.md): ``get_num_new_matched_tokens`` answered ``need``
        external tokens past ``num_computed`` (None: deferred, rule 7, nothing happens): the
        request's junction stop is decided at the hit ``num_computed + need``."""
        if need is not None:
            self.junctions.at_lookup(request, num_computed + need)

    def _junction_jobs(self, order: list[Scheduled],
                       current_table: Callable[[str], tuple[list[int], ...] | None],
                       rows: list[StoreJob]) -> None:
        """EXTENSION (junctions): each junction job of the step gets its copies, the next job
        id and its pins; the connector's reference on the fresh blocks is dropped at once."""
        steps = [(s.request, s.num_computed_tokens + s.num_scheduled) for s in order
                 if s.request.request_id in self.unfinished_requests]
        for copies, job, fresh in self.junctions.jobs(steps, current_table):
            self.step_snapshots += copies
            self._pin_extension_job(job)
            self.pool.free_ids(fresh)
            rows.append(job)

    def _new_request(self, s: Scheduled, is_consumer: bool) -> list[StoreJob]:
        req = s.request
        rid = req.request_id
        spec = self.load_specs.pop(rid, None)
        assert rid in self.unfinished_requests
        # ``len(prefill_token_ids)``: the prompt, plus the outputs of a resumed request (0.34)
        t = RequestTracker(req_id=rid, token_len=s.num_computed_tokens + s.num_scheduled,
                           allocated_block_ids=tuple(list(ids) for ids in s.block_ids),
                           prefill_end_tokens=len(req.all_token_ids))
        self.request_trackers[rid] = t
        job = from_request_tracker(
            t, self.geo.scheduler_block_size, req.block_hashes, load_spec=spec,
            skip_save=is_consumer, save_partial_tail=self.geo.partial_hits,
            num_prompt_tokens=req.num_prompt_tokens)
        return [job] if job is not None else []

    def _cached_request(self, s: Scheduled, is_consumer: bool) -> list[StoreJob]:
        req = s.request
        rid = req.request_id
        # ``get_block_ids(allow_none=True)``: None when every group is empty.
        new_ids = tuple(list(ids) for ids in s.block_ids) if any(s.block_ids) else None
        if s.kind == "resumed":
            if not new_ids:
                return []
            spec = self.load_specs.pop(rid, None)
            real, _ = self.unfinished_requests[rid]
            t = RequestTracker(req_id=rid, token_len=real.num_computed_tokens + s.num_scheduled,
                               allocated_block_ids=new_ids,
                               prefill_end_tokens=len(real.all_token_ids))
            self.request_trackers[rid] = t
            job = from_request_tracker(
                t, self.geo.scheduler_block_size, real.block_hashes, load_spec=spec,
                skip_save=is_consumer, save_partial_tail=self.geo.partial_hits,
                num_prompt_tokens=real.num_prompt_tokens)
            return [job] if job is not None else []
        t = self.request_trackers[rid]
        is_decode = s.num_computed_tokens >= t.prefill_end_tokens
        if is_decode and not self.conf.save_decode_cache:
            return []
        entry = self.unfinished_requests.get(rid)
        if entry is None:
            raise ValueError(f"Request {rid} is not in _unfinished_requests")
        real = entry[0]
        t.token_len += len(real.all_token_ids[t.token_len:t.token_len + s.num_scheduled])
        if new_ids:
            t.update(new_ids)
        if is_consumer and not is_decode:
            return []
        job = from_request_tracker(
            t, self.geo.scheduler_block_size, real.block_hashes, skip_save=False,
            save_partial_tail=self.geo.partial_hits, num_prompt_tokens=real.num_prompt_tokens)
        return [job] if job is not None else []

    def _handle_boundary_state_offloads(self, offloads: Offloads, rows: list[StoreJob],
                                        decode: dict[str, list[int]]) -> None:
        """mirrors ``_handle_boundary_state_offloads`` (MS:672-727); a decode boundary is
        accepted on 0.34 with ``save_decode_cache``, where a consumer accepts only those
        (``Release.decode_checkpoints``), and with the extension's ``decode_boundary_saves``,
        which notes it in ``decode``."""
        save_rows = {j.req_id: j for j in rows if j.can_save}
        saves_decode = self.rules.decode_checkpoints and self.conf.save_decode_cache
        for rid, entries in offloads.items():
            t = self.request_trackers.get(rid)
            entry = self.unfinished_requests.get(rid)
            if t is None or entry is None:
                continue  # finished/preempted within this step: dropped
            accepted: list[BoundaryPut] = []
            for gid, block_id, boundary in entries:
                is_decode = boundary > t.prefill_end_tokens
                if is_decode and not (self.conf.decode_boundary_saves or saves_decode):
                    continue  # decode boundary: can never complete a joint hit (0.33)
                if not is_decode and self.conf.is_consumer:
                    continue  # 0.34: a consumer stores decode checkpoints only
                if block_id == NULL_BLOCK_ID or gid not in self.geo.mamba_group_ids:
                    continue
                accepted.append(BoundaryPut(gid, block_id, boundary))
                if is_decode and self.conf.decode_boundary_saves:  # EXTENSION rule 5
                    decode.setdefault(rid, []).append(boundary)
            if not accepted:
                continue
            t.has_pending_offload = True
            if (job := save_rows.get(rid)) is not None:
                job.boundary_puts = accepted  # replaces, as vLLM does
                continue
            req = entry[0]
            rows.append(StoreJob(
                req_id=rid, token_len_chunk=0, block_ids=t.allocated_block_ids,
                block_hashes=req.block_hashes, can_save=True,
                num_prompt_tokens=req.num_prompt_tokens,
                prefill_end_tokens=t.prefill_end_tokens, boundary_puts=accepted,
                completed_token_len=t.token_len))

    def _decode_boundary_puts(self, rows: list[StoreJob], decode: dict[str, list[int]],
                              scheduled: list[Scheduled]) -> None:
        """EXTENSION rule 5: the attention puts of each accepted decode boundary go before
        the step job's Mamba puts, up to the tokens computed after this step."""
        after = {s.request.request_id: s.num_computed_tokens + s.num_scheduled
                 for s in scheduled}
        for job in rows:
            if not job.can_save or job.req_id not in decode:
                continue
            t = self.request_trackers[job.req_id]
            req = self.unfinished_requests[job.req_id][0]
            completed = after.get(job.req_id, req.num_computed_tokens)
            puts = decode_boundary_puts(self.geo, decode[job.req_id], t, completed,
                                        len(req.block_hashes), job.block_ids)
            job.boundary_puts = [*puts, *job.boundary_puts]

    def _reference_save_blocks(self, rows: list[StoreJob]) -> None:
        """mirrors ``_reference_save_blocks`` (MS:550-598): job ids and pins (with the two
        DEVIATIONS above when configured: readable pins, the pin budget)."""
        skipped: list[StoreJob] = []
        for job in rows:
            if not job.can_save:
                continue
            if job.store_job_id is not None:
                assert job.store_job_id in self.held
                continue
            tail = partial_tail_puts(self.geo, job)
            if tail:
                job.boundary_puts = [*tail, *job.boundary_puts]
            ids = [p.block_id for p in job.boundary_puts]
            assert NULL_BLOCK_ID not in ids, "A null block cannot back a boundary put"
            t = None
            if job.token_len_chunk:
                t = self.request_trackers.get(job.req_id) if self.conf.readable_pins else None
                ids += [b for b in self._save_pins(job, t) if b != NULL_BLOCK_ID]
            ids = list(dict.fromkeys(ids))
            if not self._within_budget(ids):
                skipped.append(job)
                continue
            job.store_job_id = self.next_store_job_id
            self.next_store_job_id += 1
            if not ids:
                continue
            self._pin(job.store_job_id, ids)
            if t is not None:
                self.save_jobs[job.store_job_id] = [t, t.generation, None]
            self._register_inflight(job)
        for job in skipped:
            rows.remove(job)

    def _save_pins(self, job: StoreJob, t: RequestTracker | None) -> list[int]:
        """The non-Mamba blocks a normal save may read: the whole table (vLLM), or with
        readable pins (``t`` given) ``[floor, token_len_chunk)`` (DEVIATION above)."""
        mamba = self.geo.mamba_group_ids
        if t is None:
            return [b for gid, table in enumerate(job.block_ids) if gid not in mamba
                    for b in table]
        floor = min(job.token_ids_start, t.confirmed[1])
        job.pin_floor = floor
        return [b for gid, table in enumerate(job.block_ids) if gid not in mamba
                for b in table[floor // self.geo.block_sizes[gid]:
                               cdiv(job.token_len_chunk, self.geo.block_sizes[gid])]]

    def _within_budget(self, ids: list[int]) -> bool:
        """DEVIATION (pin budget): whether the blocks still pinned when this step's meta began
        (earlier jobs, ``earlier_pins``) plus ``ids`` stay within ``pin_budget``; a job beyond
        it is skipped (never gets an id)."""
        held = self.earlier_pins
        return self.pin_budget is None or not ids or not held or (
            held + len(ids) <= self.pin_budget)

    def _pin(self, job_id: int, ids: list[int]) -> None:
        """``pool.touch`` of a job's distinct blocks, held until every rank reported."""
        self.held[job_id] = (ids, self.num_workers)
        self.pool.touch_ids(ids)

    def _register_inflight(self, job: StoreJob) -> None:
        """EXTENSION rule 7: a pinned job's Mamba keys are waited on until it is released."""
        if self.inflight is not None:
            self.inflight.register(job)

    # --- finish-time hand-off ----------------------------------------------------------

    def register_finished_partial_tail(self, request: RequestLike,
                                       block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]],
                                       ) -> StoreJob | None:
        """mirrors ``register_finished_partial_tail`` (MS:600-670): pin the finish-time tail
        (and its attention tail puts) now, emit the job with the next step. Never delays the
        core free (returns the job, vLLM returns False)."""
        if self.conf.is_consumer or not partial_tail_offloads:
            return None
        t = self.request_trackers.get(request.request_id)
        if t is None or not any(block_ids):
            return None
        boundaries = {b for _, _, b in partial_tail_offloads}
        if len(boundaries) != 1:
            raise ValueError("Partial-tail offloads for one request must share a boundary")
        boundary = next(iter(boundaries))
        if boundary > t.prefill_end_tokens:
            return None
        mamba_puts: list[BoundaryPut] = []
        for gid, block_id, b in partial_tail_offloads:
            if gid not in self.geo.mamba_group_ids or block_id == NULL_BLOCK_ID:
                return None
            mamba_puts.append(BoundaryPut(gid, block_id, b))
        job = StoreJob(req_id=request.request_id, token_len_chunk=0,
                  block_ids=tuple(list(ids) for ids in block_ids),
                  block_hashes=list(request.block_hashes), can_save=True,
                  num_prompt_tokens=request.num_prompt_tokens,
                  prefill_end_tokens=t.prefill_end_tokens, boundary_puts=mamba_puts,
                  completed_token_len=request.num_computed_tokens)
        job.boundary_puts = [*partial_tail_puts(self.geo, job), *mamba_puts]
        ids = list(dict.fromkeys(p.block_id for p in job.boundary_puts))
        assert request.request_id not in self.finished_partial_tails
        if not self._within_budget(ids):
            return None  # DEVIATION (pin budget): the tail is not stored
        job.store_job_id = self.next_store_job_id
        self.next_store_job_id += 1
        self._pin(job.store_job_id, ids)
        self._register_inflight(job)
        self.finished_partial_tails[request.request_id] = job
        t.has_pending_offload = True
        return job

    # --- EXTENSION: the turn-end checkpoint at finish (docs/reuse.md rule 3) -------------

    def finish_turn(self, request: RequestLike, block_ids: tuple[list[int], ...]
                    ) -> StoreJob | None:
        """Called at finish after ``register_finished_partial_tail``: the request's last
        snapshot becomes a store job that gets the next job id and pins its blocks now; the
        connector then drops its own reference on the slots (the pin keeps them until every
        worker reported). Emitted with the next step, after the partial tails."""
        rid = request.request_id
        job = self.turn_end.flush(
            rid, self.request_trackers.get(rid), request.num_computed_tokens,
            request.block_hashes, request.num_prompt_tokens, block_ids)
        if job is None:
            return None
        self._pin_extension_job(job)
        self.turn_end.release(rid)
        self.turn_end_jobs[rid] = job
        return job

    def _pin_extension_job(self, job: StoreJob) -> None:
        """EXTENSION: the next job id, one pin per distinct block the job puts, its keys
        waited on (rule 7)."""
        job.store_job_id = self.next_store_job_id
        self.next_store_job_id += 1
        ids = list(dict.fromkeys(p.block_id for p in job.boundary_puts))
        self.held[job.store_job_id] = (ids, self.num_workers)
        self.pool.touch_ids(ids)
        self._register_inflight(job)

    # --- completion --------------------------------------------------------------------

    def update_connector_output(self, completed_saves: dict[int, int],
                                saved_offsets: dict[int, int] | None = None) -> list[int]:
        """mirrors ``update_connector_output`` (MS:729-751); returns the released job ids.
        ``saved_offsets`` (DEVIATION, readable pins): per job, the lowest offset of its request
        on the reporting ranks once it was over (absent: 0, confirms nothing)."""
        released = []
        offsets = saved_offsets or {}
        for job_id, count in completed_saves.items():
            entry = self.held.get(job_id)
            if entry is None:
                continue  # the job pinned nothing
            if (ent := self.save_jobs.get(job_id)) is not None:
                off = offsets.get(job_id, 0)
                ent[2] = off if ent[2] is None else min(ent[2], off)
            ids, remaining = entry
            remaining -= count
            if remaining > 0:
                self.held[job_id] = (ids, remaining)
                continue
            assert remaining == 0, f"store job {job_id} reported by too many ranks"
            del self.held[job_id]
            if ent is not None:  # DEVIATION (readable pins): the ranks' offsets confirmed
                del self.save_jobs[job_id]
                t, generation, off = ent
                if t.generation == generation and job_id > t.confirmed[0]:
                    t.confirmed = (job_id, off)
            if self.inflight is not None:
                self.inflight.release(job_id)  # EXTENSION rule 7
            self.pool.free_ids(list(reversed(ids)))
            released.append(job_id)
        return released

    def has_pending_push_work(self) -> bool:
        return bool(self.held)
