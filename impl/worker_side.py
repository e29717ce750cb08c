"""Worker role: a step's loads and store jobs against the KV cache tensors, off the step.
One module (over 600 lines) because it mirrors one vLLM class, ``MooncakeStoreWorker``,
method for method; the data plane, layout and value format are already modules of their own.

Semantics: ``tailproof.reference.connector.worker`` (store jobs; loads have no reference model,
their bytes are checked by the ``impl`` adapter). Mirrors vLLM 0.33's ``MooncakeStoreWorker``
(``KVCacheStoreSendingThread._handle_request``, ``KVCacheStoreRecvingThread._handle_request``,
``_close_ended_store_requests``), and so does the threading (its ``start_load_kv`` /
``wait_for_save`` only enqueue); the threads, queues and staging pool are ``data_plane``'s.
Written independently of ``tailproof.reference.connector.worker`` on purpose (not shared):
the corpus compares the two op by op, and both with vLLM's own code on ``vllm-mooncake``;
a shared body would compare a function with itself. Pure arithmetic is shared instead
(``spec.arithmetic``). Per step:

* loads (``start_load_kv``): an asynchronous load (the default) is queued for a receiver
  thread and the request waits (``WAITING_FOR_REMOTE_KVS``) until ``get_finished`` reports it.
  The receiver reads every key of the request in one all-or-nothing ``read_batch``; only when
  *all* arrived intact (``Outcome.ok``) are they copied into the request's blocks, then it is
  reported finished, a failed one also in ``failed_recving``. A synchronous load (single-group
  models only) feeds this very step's forward, so it runs in ``start_load_kv``; its failure is
  reported through ``get_block_ids_with_load_errors``. Either way vLLM recomputes -- fail
  closed, a failed load is never served;
* store jobs (``wait_for_save``, after the step's forward): queued for a sender thread, which
  runs the boundary puts, then the normal save from this rank's saved offset; keys already
  stored are skipped; every job is reported done exactly once (``TailproofWorkerMeta``) however
  it ended, and only then does the scheduler drop its pins -- which is what keeps the blocks a
  sender reads from being reused meanwhile. Each report also carries the rank's saved offset
  (``readable_pins``: the scheduler pins a later save only from there); a normal save whose
  rank offset lies below the job's ``pin_floor`` reads nothing (``saves_below_pin_floor``).
  On a GPU the step records a CUDA event after its
  forward and CoW copies; the sender's device-to-host copy waits for it on its own stream;
* bytes: a save copies each block once, from the KV tensors into the store value
  (``Store.write_batch``: the memory store's own array, else pinned/registered staging that
  the store then transfers from); a load copies once out of the store value into the blocks
  (``Store.read_batch``). ``_put_values`` / ``_get_values`` are the one place where KV bytes
  become store values and back;
* a full queue never blocks the step: a store job that cannot be queued is skipped and
  reported done (counted ``jobs_skipped_queue_full``; its range is saved by the request's next
  job, as after a pressure skip), a load that cannot be queued fails closed;
* pressure gate: a put answered STORE_FULL marks the store under pressure and the request
  skipped; later jobs of skipped requests put nothing until any fully successful put batch
  clears the gate (Mooncake's ``_store_pressure_active`` / ``_skip_store_requests``);
* values (``value_format``): every put writes a header (fingerprint, key, length, checksum,
  MAC identity, optional MAC) in front of the block's bytes, in the same buffer the block was
  copied into; every get verifies it before the first block is written. One rule for every
  failure (the store's ``WRONG_SIZE``, or any ``ValueCodec.verify`` kind): the load fails, the
  value is never served and it is removed, so the next save rewrites it (write-once ``exists``
  no longer finds it). Keys name this engine's MAC identity, so what fails here is corrupt,
  never another engine's value (``_reject``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.data_plane import Lanes, StagingPool
from tailproof.impl.fingerprint import Fingerprint, geometry_fingerprint
from tailproof.impl.keys import INITIAL_EPOCH, KeySpace
from tailproof.impl.kv_layout import KVLayout
from tailproof.impl.meta import LoadJob, StoreJob, TailproofMeta, TailproofWorkerMeta
from tailproof.impl.metrics import WorkerMetrics
from tailproof.impl.stores import Status, Store
from tailproof.impl.value_format import (
    HEADER_BYTES,
    ValueCodec,
    mac_identity_text,
    slot_nbytes,
)
from tailproof.impl.vllm_release import monotone_saved_offset
from tailproof.spec.arithmetic import NULL_BLOCK_ID, cdiv

logger = logging.getLogger(__name__)



class PressureGate:
    """Mooncake's store-pressure state machine (invariant: skip set non-empty => active)."""

    def __init__(self) -> None:
        self.store_pressure_active = False
        self.skip_store_requests: set[str] = set()

    def should_skip(self, req_id: str) -> bool:
        return self.store_pressure_active and req_id in self.skip_store_requests

    def clear(self) -> None:
        self.store_pressure_active = False
        self.skip_store_requests.clear()


class WorkerSide:
    """The connector's worker role (one per GPU worker / tensor-parallel rank).

    ``manual=True`` (tests, the conformance adapter): the sender and receiver threads start a
    job only when :meth:`run` / :meth:`run_loads` hand it to them, and those calls wait for it;
    otherwise they run free. State the step and the threads share (ledger, offsets, gate,
    reports) is guarded by one lock; store I/O and copies run outside it.

    ``keep_load_outcomes=True`` (callers that run loads themselves and read each one's result:
    tests, the conformance adapter, a benchmark): each request's last load outcome stays in
    :attr:`load_ok` until the caller pops it. The engine learns outcomes from
    ``finished_recving`` / ``failed_recving`` and the load-error blocks instead, so it keeps
    none: an entry per request that loaded would outlive the request (nothing there pops it).
    """

    def __init__(
        self, settings: Settings, geo: StoreGeometry, store: Store, rank: int, world: int,
        coord: Any = None, metrics: WorkerMetrics | None = None,
        fingerprint: Fingerprint | None = None, secret: bytes | None = None, tp_size: int = 1,
        *, manual: bool = False, keep_load_outcomes: bool = False,
    ):
        fp = fingerprint or geometry_fingerprint(geo)
        self.keys = KeySpace(settings.namespace, fp.digest, tp_size, mac_identity_text(secret))
        self.codec = ValueCodec(fp.raw, secret)
        self.settings = settings
        self._can_put = settings.can_put  # read every step; settings are frozen
        self.geo = geo
        self.store = store
        self.rank = rank
        self.world = world
        self.coord = coord
        self.metrics = metrics or WorkerMetrics()
        self.manual = manual
        self.layout: KVLayout | None = None
        self.pool: StagingPool | None = None
        self.senders: Lanes[StoreJob] | None = None
        self.receivers: Lanes[LoadJob] | None = None
        self.copy_stream: Any = None  # CUDA: the stream background copies run on
        self._lock = threading.Lock()
        self.gate = PressureGate()
        self.saved_offset: dict[str, int] = {}  # per-rank normal-save resume point
        self.stored_requests: dict[str, set[int]] = {}  # live store jobs per request
        self.finished_store_req: set[str] = set()  # finished requests whose jobs are still queued
        self.completed_saves: dict[int, int] = {}
        self.saved_offsets: dict[int, int] = {}  # job -> its request's offset once it was over
        self.job_errors: dict[int, str] = {}  # job id -> exception class name (drained by run)
        self._events: dict[int, Any] = {}  # job id -> CUDA event after its step's forward
        self._enqueued_at: dict[int, float] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_error_blocks: set[int] = set()
        self.load_ok: dict[str, bool] = {}  # request -> whether its last load succeeded
        self._keep_load_outcomes = keep_load_outcomes
        # vllm_release: the offset only moves forward, after a save with nothing missing (0.34)
        self._monotone = monotone_saved_offset()

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(
        self, kv_caches: dict[str, Any], layer_groups: Sequence[Sequence[str]]
    ) -> None:
        """Index the KV tensors per store group, allocate the staging pool, start threads."""
        self.layout = KVLayout(kv_caches, layer_groups, self.geo.num_blocks)
        need = max([0, *map(slot_nbytes, self.layout.block_nbytes)])
        size = max(self.settings.staging_buffer_bytes, need)
        cuda = self.layout.device.type == "cuda"
        s = self.settings
        self.pool = StagingPool(s.send_threads + s.recv_threads, size, pin=cuda,
                                register=self.store.register_buffer,
                                unregister=self.store.unregister_buffer)
        if cuda:
            self.copy_stream = torch.cuda.Stream(device=self.layout.device)
        self.senders = Lanes(f"tailproof-send-r{self.rank}", self._run_store_job,
                             self._abandon_store_job, threads=s.send_threads,
                             max_queued=s.max_queued_jobs, manual=self.manual)
        # Saves are throughput work (bounded queue, pins only delay block reuse): they yield
        # the CPU to the step. A load has a request waiting on it: normal priority.
        self.receivers = Lanes(f"tailproof-recv-r{self.rank}", self._run_load,
                               self._abandon_load, threads=s.recv_threads,
                               max_queued=s.max_queued_jobs, manual=self.manual, nice=0)

    def close(self, timeout: float = 30.0) -> None:
        """Finish every queued job (or report it failed after ``timeout``), stop the threads,
        release the staging pool. Every job ends reported, so its pins can be released."""
        for lanes in (self.senders, self.receivers):
            if lanes is not None:
                lanes.close(timeout)
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no load or store job is queued or running (free-running threads)."""
        ok = True
        for lanes in (self.senders, self.receivers):
            if lanes is not None:
                ok = lanes.wait_idle(timeout) and ok
        return ok

    def key(self, group: int, block_hash: bytes, epoch: str = INITIAL_EPOCH) -> str:
        return self.keys.key(self.rank, group, block_hash, epoch)

    def _slot(self, group: int) -> int:
        """Bytes of one stored value of ``group``: header + the block's bytes."""
        assert self.layout is not None
        return slot_nbytes(self.layout.block_nbytes[group])

    @property
    def queue(self) -> list[StoreJob]:
        """Store jobs queued and not started yet, in the order they will run."""
        return self.senders.queued() if self.senders is not None else []

    # ------------------------------------------------------------------ loads

    def start_load(self, meta: TailproofMeta) -> None:
        """Queue this step's asynchronous loads; run a synchronous one now (it feeds this
        step's forward). A load that cannot be queued fails closed at once."""
        assert self.receivers is not None
        for job in meta.loads:
            if not job.is_async:
                self._run_load(job)
                continue
            self._enqueued_at[id(job)] = time.perf_counter()
            if not self.receivers.submit(job.req_id, job):
                self.metrics.c.inc("loads_rejected_queue_full")
                self._finish_load(job, False)

    def run_loads(self, n: int | None = None) -> list[LoadJob]:
        """Manual mode: run up to ``n`` queued loads (all when None) and wait for them."""
        assert self.receivers is not None
        done: list[LoadJob] = []
        while n is None or len(done) < n:
            job = self.receivers.run_next()
            if job is None:
                break
            done.append(job)
        return done

    def _run_load(self, job: LoadJob) -> None:
        try:
            ok = self._load(job)
        except Exception:  # fail closed: an unexpected error is a failed load, not a crash
            logger.exception("load of %s failed", job.req_id)
            ok = False
        self._finish_load(job, ok)

    def _abandon_load(self, job: LoadJob) -> None:
        self._finish_load(job, False)

    def _finish_load(self, job: LoadJob, ok: bool) -> None:
        t0 = self._enqueued_at.pop(id(job), None)
        if t0 is not None:
            self.metrics.c.sample("load_latency_s", time.perf_counter() - t0)
        if not ok:
            self.metrics.c.inc("load_failures")
        with self._lock:
            if self._keep_load_outcomes:
                self.load_ok[job.req_id] = ok
            if job.is_async:
                self.finished_recving.add(job.req_id)
                if not ok:
                    self.failed_recving.add(job.req_id)
            elif not ok:
                self.load_error_blocks.update(self._target_blocks(job))

    def _target_blocks(self, job: LoadJob) -> list[int]:
        """The request's blocks the load would fill (its private, freshly allocated blocks past
        the block-aligned local hit): reported by id when a synchronous load fails."""
        sbs = self.geo.scheduler_block_size
        start = job.vllm_cached_tokens // sbs * sbs
        return [b for g, bs in enumerate(self.geo.block_sizes)
                for b in job.block_ids[g][start // bs :] if b != NULL_BLOCK_ID]

    def load_plan(self, job: LoadJob) -> list[tuple[int, int, bytes]]:
        """(group, block id, key hash) of every block the load fills."""
        geo = self.geo
        h = geo.hash_block_size
        start = job.vllm_cached_tokens // geo.scheduler_block_size * geo.scheduler_block_size
        masks = (self.coord.load_mask(job.block_hashes, job.kvpool_cached_tokens)
                 if self.coord else None)
        plan: list[tuple[int, int, bytes]] = []
        for g, bs in enumerate(geo.block_sizes):
            last = cdiv(job.kvpool_cached_tokens, bs) - 1
            for idx in range(start // bs, last + 1):
                if geo.is_mamba[g] and idx != last:
                    continue  # a Mamba group needs only the state at the hit
                if masks is not None and (idx >= len(masks[g]) or not masks[g][idx]):
                    continue
                end = min((idx + 1) * bs, job.kvpool_cached_tokens)
                if idx == last and job.tail_key_boundaries:
                    end = job.tail_key_boundaries[g].num_tokens
                plan.append((g, job.block_ids[g][idx], job.block_hashes[end // h - 1]))
        return plan

    def _load(self, job: LoadJob) -> bool:
        try:
            plan = self.load_plan(job)
        except (IndexError, KeyError) as exc:
            logger.warning("load plan of %s failed: %s", job.req_id, exc)
            return False
        if any(b == NULL_BLOCK_ID for _, b, _ in plan):
            return False
        if not plan:
            return True
        return self._get_values([(g, b) for g, b, _ in plan],
                                [self.key(g, hh, job.epoch) for g, _, hh in plan])

    def _get_values(self, blocks: list[tuple[int, int]], keys: list[str]) -> bool:
        """Store values -> KV blocks, all or nothing: every value's header is verified
        (``ValueCodec.verify``) before the first block is written, then each payload is
        copied once into its block. Bytes passes on CPU: the checksum reads the value, the
        copy reads it again (the memory store hands out its own arrays; other stores first
        transfer into staging)."""
        assert self.layout is not None and self.pool is not None
        layout, codec = self.layout, self.codec
        sizes = [self._slot(g) for g, _ in blocks]
        cuda = self.copy_stream is not None
        bad: list[tuple[str, str]] = []  # (key, failure kind)

        crew = self.store.copies  # values are verified, then scattered, on the store's crew

        def consume(values: list[np.ndarray]) -> None:
            def check(i: int) -> None:
                kind = codec.verify(keys[i], values[i])
                if kind is not None:
                    bad.append((keys[i], kind))  # list.append is atomic across threads

            def scatter(i: int) -> None:
                g, b = blocks[i]
                layout.write_block(g, b, values[i][HEADER_BYTES:])

            total = sum(v.nbytes for v in values)
            crew.for_each(len(values), check, total)
            if bad:
                bad.sort()  # the crew's order varies; what is reported does not
                return  # fail closed: not one block is written
            if not cuda:
                crew.for_each(len(values), scatter, total)
                return
            with warnings.catch_warnings():  # the memory store hands out read-only arrays
                warnings.simplefilter("ignore", UserWarning)
                with torch.cuda.stream(self.copy_stream):
                    for (g, b), v in zip(blocks, values, strict=True):
                        layout.write_block(g, b, torch.from_numpy(v[HEADER_BYTES:]))
            self.copy_stream.synchronize()  # values are only valid inside consume

        with self.pool.take(sum(sizes)) as buf:
            outs = self.store.read_batch(keys, sizes, consume, staging=buf.numpy())
        self.metrics.record_batch("get", outs, sum(o.nbytes for o in outs if o.ok))
        # A value of the wrong size never reached ``consume``: the store proved it bad.
        bad.extend((k, "length") for k, o in zip(keys, outs, strict=True)
                   if o.status is Status.WRONG_SIZE)
        if bad:
            self._reject(bad)
            return False
        return bool(outs) and all(o.ok for o in outs)

    def _reject(self, bad: list[tuple[str, str]]) -> None:
        """The one rule for values that failed verification (docs/store-format.md): count each
        by kind and remove every one, so the next save rewrites it and one bad value cannot
        fail its prefix until evicted. Every key read here names this engine's MAC identity
        (``KeySpace``), so a value failing under it is corrupt whatever the kind (a header
        naming another identity included): no other engine's value is ever read, let alone
        removed."""
        for _, kind in bad:
            self.metrics.c.inc(f"verify_fail_{kind}")
        logger.warning("removing %d stored value(s) that failed verification, e.g. %s (%s)",
                       len(bad), bad[0][0], bad[0][1])
        self.metrics.c.inc("verify_removed", self.store.remove([k for k, _ in bad]))

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, meta: TailproofMeta) -> None:
        """Copy this step's snapshots, queue its store jobs for the sender(s), then retire
        ended requests. On a GPU the snapshot copies are queued on the step's stream after its
        forward, and one CUDA event, recorded after them, orders every job's copies after this
        step's forward, CoW copies and snapshots; nothing here waits."""
        if meta.snapshots:
            self.copy_snapshots(meta)
        if self._can_put and meta.stores:
            event = None
            if self.copy_stream is not None:
                event = torch.cuda.Event()
                event.record()
            for job in meta.stores:
                self.add_request(job, event)
        self.close_ended_store_requests(meta.finished_req_ids, meta.preempted_req_ids)

    def copy_snapshots(self, meta: TailproofMeta) -> None:
        """Rule 2 of docs/reuse.md: each snapshot's Mamba state (every state tensor of every
        layer of its group) ``src -> slot``, synchronously on the current stream: ``slot`` then
        holds the state of the prefix ``boundary`` (this step's forward wrote ``src``)."""
        assert self.layout is not None
        n = 0
        for snap in meta.snapshots:
            if snap.src_block == NULL_BLOCK_ID or snap.slot_block == NULL_BLOCK_ID:
                raise AssertionError(f"snapshot of {snap.req_id} names the null block")
            n += self.layout.copy_block(snap.group, snap.src_block, snap.slot_block)
        self.metrics.c.inc("snapshot_copies", len(meta.snapshots))
        self.metrics.c.inc("snapshot_copy_bytes", n)

    def add_request(self, job: StoreJob, event: Any = None) -> None:
        """Register a job as live for its request and queue it (``add_request``); when the
        queue is full the job is skipped and reported done at once (never blocks)."""
        assert self.senders is not None
        with self._lock:
            self.stored_requests.setdefault(job.req_id, set()).add(job.store_job_id)
            if event is not None:
                self._events[job.store_job_id] = event
            self._enqueued_at[job.store_job_id] = time.perf_counter()
        if not self.senders.submit(job.req_id, job):
            self.metrics.c.inc("jobs_skipped_queue_full")
            self._report(job)

    def run(self, n: int | None = None) -> list[tuple[StoreJob, str | None]]:
        """Manual mode: let the sender run up to ``n`` queued jobs (all when None), FIFO, each
        waited for. Returns (job, exception class name or None) per job run."""
        assert self.senders is not None
        done: list[tuple[StoreJob, str | None]] = []
        while n is None or len(done) < n:
            job = self.senders.run_next()
            if job is None:
                break
            with self._lock:
                err = self.job_errors.pop(job.store_job_id, None)
            done.append((job, err))
        return done

    def _run_store_job(self, job: StoreJob) -> None:
        try:
            self._handle_request(job)
        except Exception as exc:  # a store bug must not wedge the pins: report the job
            logger.exception("store job %d of %s failed", job.store_job_id, job.req_id)
            self.metrics.c.inc("job_errors")
            with self._lock:
                self.job_errors[job.store_job_id] = type(exc).__name__
        finally:
            self._report(job)

    def _abandon_store_job(self, job: StoreJob) -> None:
        """Shutdown gave up on a queued job: it puts nothing, but it is reported."""
        self.metrics.c.inc("jobs_abandoned")
        self._report(job)

    def _report(self, job: StoreJob) -> None:
        """The job is over on this rank: retire it from the ledger, count it for the report."""
        jid = job.store_job_id
        assert jid is not None
        with self._lock:
            live = self.stored_requests.get(job.req_id)
            if live is not None:
                live.discard(jid)
            self.completed_saves[jid] = self.completed_saves.get(jid, 0) + 1
            self.saved_offsets[jid] = self.saved_offset.get(job.req_id, 0)
            self._events.pop(jid, None)
            t0 = self._enqueued_at.pop(jid, None)
            active = self.gate.store_pressure_active
        if t0 is not None:
            self.metrics.c.sample("job_latency_s", time.perf_counter() - t0)
        self.metrics.c.set("pressure_active", int(active))

    def close_ended_store_requests(self, finished: set[str], preempted: set[str]) -> None:
        """Retire request state: preempted now (their queued jobs become not live), finished
        once their queued jobs drained (``_close_ended_store_requests``)."""
        # Also in reference.connector.worker: impl and the reference it is checked against
        # must not share a body (docs/architecture.md); both mirror vLLM 0.33 MW:1979-1990.
        with self._lock:
            for rid in preempted:
                self.delete_finished_stored_request(rid)
            for rid in finished | self.finished_store_req:
                if self.stored_requests.get(rid):
                    self.finished_store_req.add(rid)
                else:
                    self.finished_store_req.discard(rid)
                    self.delete_finished_stored_request(rid)

    def delete_finished_stored_request(self, rid: str) -> None:
        self.stored_requests.pop(rid, None)
        self.gate.skip_store_requests.discard(rid)
        self.saved_offset.pop(rid, None)

    def _live(self, job: StoreJob) -> bool:
        return job.store_job_id in self.stored_requests.get(job.req_id, ())

    def _handle_request(self, job: StoreJob) -> None:
        lcm = self.geo.scheduler_block_size
        token_len = job.token_len_chunk // lcm * lcm
        with self._lock:
            live = self._live(job)
            skip = live and self.gate.should_skip(job.req_id)
            start = self.saved_offset.get(job.req_id, 0)
        if not live:
            self.metrics.c.inc("jobs_not_live")
            return
        if skip:
            self.metrics.c.inc("jobs_skipped_pressure")
            return
        if not self._boundary_puts(job):
            return  # a failed boundary put also skips this job's normal save
        if token_len == 0 or self._monotone and token_len <= start:
            return
        if start < job.pin_floor:
            # ``readable_pins``: the blocks below the job's pin floor may be reused already.
            # Read nothing; the offset stays and this report makes the next job pin from it.
            self.metrics.c.inc("saves_below_pin_floor")
            return
        items: list[tuple[int, int, bytes]] = []
        missing = False  # an unavailable source block the save should have read
        h = self.geo.hash_block_size
        masks = self._store_masks(job, token_len, start)
        for g, bs in enumerate(self.geo.block_sizes):
            if self.geo.is_mamba[g]:
                continue  # Mamba states are stored only at exact hand-off boundaries
            table = job.block_ids[g]
            first, mask = cdiv(start, bs), masks[g]
            stop = cdiv(token_len, bs)
            if mask is not None:
                stop = min(stop, first + len(mask))
            for idx in range(first, stop):
                if mask is not None and not mask[idx - first]:
                    continue  # a block no hit at an lcm boundary can use (sliding window)
                end = min((idx + 1) * bs, token_len)
                if idx >= len(table) or table[idx] == NULL_BLOCK_ID:
                    missing = True
                    continue
                items.append((g, table[idx], job.block_hashes[end // h - 1]))
        result = self._put(job, items)
        done = result != "failed" and not (self._monotone and missing)  # 0.34: retried
        with self._lock:
            if done and self._live(job):
                prev = self.saved_offset.get(job.req_id, 0) if self._monotone else 0
                self.saved_offset[job.req_id] = max(prev, token_len)
            if result == "ok" and done:
                self.gate.clear()

    def _store_masks(self, job: StoreJob, token_len: int,
                     start: int) -> tuple[list[bool] | None, ...]:
        """Per group, which blocks from ``cdiv(start, bs)`` on the normal save writes
        (``MooncakeStoreCoordinator.store_mask``, as ``KVCacheStoreSendingThread._handle_request``
        uses it): every full-attention block, of a sliding window only the blocks a hit at an lcm
        boundary can use. Without vLLM's coordinator (unit tests), every block."""
        if self.coord is None:
            return (None,) * self.geo.num_groups
        return tuple(self.coord.store_mask(token_len, start,
                                           num_prompt_tokens=job.prefill_end_tokens))

    def _boundary_puts(self, job: StoreJob) -> bool:
        h = self.geo.hash_block_size
        items = [
            (p.group_id, p.block_id, job.block_hashes[p.num_tokens // h - 1])
            for p in job.boundary_puts
            if p.num_tokens > 0 and p.block_id != NULL_BLOCK_ID
            and p.num_tokens // h <= len(job.block_hashes)
        ]
        result = self._put(job, items)
        if result == "ok":
            with self._lock:
                self.gate.clear()
        return result != "failed"

    def _put(self, job: StoreJob, items: list[tuple[int, int, bytes]]) -> str:
        """Put the keys of ``items`` the store lacks, in order, as one batch (split only to fit
        a staging buffer). "none": nothing was missing; "ok": all stored; "failed": any key
        failed (STORE_FULL marks the pressure gate)."""
        assert self.layout is not None and self.pool is not None
        if not items:
            return "none"
        keys = [self.key(g, hh, job.epoch) for g, _, hh in items]
        present = self.store.exists(keys)
        todo = [(it, k) for it, k, p in zip(items, keys, present, strict=True) if not p]
        if not todo:
            return "none"
        sizes = [self._slot(g) for (g, _, _), _ in todo]
        cap = self.pool.nbytes
        i = 0
        while i < len(todo):
            j, used = i, 0
            while j < len(todo) and j - i < self.settings.put_batch_size and (
                    j == i or used + sizes[j] <= cap):
                used += sizes[j]
                j += 1
            outs = self._put_values(job, [(g, b) for (g, b, _), _ in todo[i:j]],
                                    [k for _, k in todo[i:j]], sizes[i:j])
            self.metrics.record_batch("put", outs, sum(o.nbytes for o in outs if o.ok))
            if not all(o.saved for o in outs):
                if any(o.status is Status.STORE_FULL for o in outs):
                    with self._lock:
                        self.gate.store_pressure_active = True
                        if self._live(job):
                            self.gate.skip_store_requests.add(job.req_id)
                return "failed"
            i = j
        return "ok"

    def _put_values(self, job: StoreJob, blocks: list[tuple[int, int]], keys: list[str],
                    sizes: list[int]) -> list[Any]:
        """KV blocks -> sealed store values, one batch. ``sizes`` are slot sizes (header +
        block). CPU: each block is copied once, straight into its value's payload
        (``Store.write_batch``: the memory store's own array, else registered staging), then
        ``ValueCodec.seal`` hashes the payload into the header -- two passes. GPU:
        device-to-host copies into pinned staging on the copy stream, after the job's step
        event (this thread waits, the step does not), then the same seal."""
        assert self.layout is not None and self.pool is not None
        layout, codec = self.layout, self.codec
        with self.pool.take(sum(sizes)) as buf:
            if self.copy_stream is None:
                def produce(i: int, out: np.ndarray) -> None:
                    layout.read_block(blocks[i][0], blocks[i][1], out[HEADER_BYTES:])
                    codec.seal(keys[i], out)

                return self.store.write_batch(keys, sizes, produce, staging=buf.numpy())
            with self._lock:
                event = self._events.get(job.store_job_id)
            views, off = [], 0
            with torch.cuda.stream(self.copy_stream):
                if event is not None:
                    self.copy_stream.wait_event(event)
                for (g, b), n in zip(blocks, sizes, strict=True):
                    view = buf[off : off + n]
                    layout.read_block(g, b, view[HEADER_BYTES:])
                    views.append(view)
                    off += n
            self.copy_stream.synchronize()
            for key, view in zip(keys, views, strict=True):
                codec.seal(key, view)
            return self.store.put_batch(keys, views)

    # ------------------------------------------------------------------ reports

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call (failed ⊆ finished)."""
        with self._lock:
            done, failed = self.finished_recving, self.failed_recving
            self.finished_recving, self.failed_recving = set(), set()
        return done, failed

    def take_load_error_blocks(self) -> set[int]:
        with self._lock:
            out, self.load_error_blocks = self.load_error_blocks, set()
        return out

    def build_connector_worker_meta(self) -> TailproofWorkerMeta | None:
        with self._lock:
            if not self.completed_saves:
                return None
            out, self.completed_saves = self.completed_saves, {}
            offs, self.saved_offsets = self.saved_offsets, {}
        self.metrics.c.set("queued_jobs", self.senders.pending if self.senders else 0)
        return TailproofWorkerMeta(completed_saves=out, saved_offsets=offs)
