"""One worker rank's store sending thread, run synchronously job by job.

Mirrors ``KVCacheStoreSendingThread`` (MW:397-1045) and the ledger retirement of
``MooncakeStoreWorker._close_ended_store_requests`` (MW:2063-2085). Per job, in order:

1. not live (its request was preempted/retired since it was queued) -> nothing;
2. pressure gate: while pressure is active, a request in the skip set puts nothing (MW:548);
3. boundary puts, deduped against the store; a failed batch (-200 sets the pressure gate and,
   for a live job, skips its request) keeps its keys absent and skips this job's normal save
   (``_maybe_offload_boundary_states``, MW:615-725); a fully successful batch clears the gate;
4. an offload-only job (``token_len_chunk == 0``) stops here;
5. the normal save of the lcm-floored range from this rank's own offset: the chunks
   ``store_mask`` keeps (no Mamba chunk; of a sliding window only the blocks a hit at an lcm
   boundary can use, ``masks.store_mask``), null or missing sources skipped, each chunk keyed
   by its block-end hash; the offset advances only on full success of a live job, which also
   clears the gate; -200 marks pressure. 0.33 counts a save whose sources were partly
   unavailable as a success and sets the offset to the job's length; 0.34 records
   ``max(offset, length)`` only when no source was missing either (else the range is retried
   by the next job) and skips a job at or below the offset (``Release.monotone_saved_offset``).
   DEVIATION (readable pins, ``scheduler.py``): a rank
   whose offset lies below the job's ``pin_floor`` saves nothing (the blocks below it are not
   pinned), and every report carries the rank's offset once the job was over.

Every path reports the job exactly once (the single ``finally``), so the scheduler can release
its pins: skipped, failed and not-live jobs included.

``tailproof.impl.worker_side`` restates these rules independently on purpose: the corpus
compares the two (and both with vLLM's own code), so neither imports the other.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.masks import store_mask
from tailproof.reference.connector.meta import StoreJob
from tailproof.reference.connector.store import NO_AVAILABLE_HANDLE, ScriptedStore
from tailproof.reference.connector.tail import NULL_BLOCK_ID
from tailproof.reference.releases import Release, release
from tailproof.spec.arithmetic import cdiv, round_down

Key = tuple[int, int, bytes]  # (rank, store group, prefix digest)
Tag = tuple[int, int, int, str]  # (rank, store group, boundary, writer request)


class SendingWorker:
    def __init__(self, rank: int, geo: StoreGeometry, store: ScriptedStore,
                 rules: Release | None = None) -> None:
        self.rank = rank
        self.geo = geo
        self.store = store
        self.rules = rules or release(None)  # the vLLM release followed (releases.py)
        self.stored_requests: dict[str, set[int]] = {}  # live job ids per request
        self.completed_saves: dict[int, int] = {}  # drained by reports
        # DEVIATION (readable pins, scheduler.py): job -> its request's offset once it was over
        self.saved_offsets: dict[int, int] = {}
        self.store_pressure_active = False
        self.skip_store_requests: set[str] = set()
        self.saved_offset: dict[str, int] = {}  # per-request resume point of the normal save
        self.queue: deque[StoreJob] = deque()
        self.finished_store_req: set[str] = set()

    # --- ledger ------------------------------------------------------------------------

    def add_request(self, job: StoreJob) -> None:
        """``add_request``: register before enqueueing (MW:463-470)."""
        assert job.store_job_id is not None
        self.stored_requests.setdefault(job.req_id, set()).add(job.store_job_id)
        self.queue.append(job)

    def _live(self, job: StoreJob) -> bool:
        return job.store_job_id in self.stored_requests.get(job.req_id, ())

    def delete_finished_stored_request(self, rid: str) -> None:
        """``delete_finished_stored_request`` (MW:478-484)."""
        self.stored_requests.pop(rid, None)
        self.skip_store_requests.discard(rid)
        self.saved_offset.pop(rid, None)

    def close_ended_store_requests(self, finished: set[str], preempted: set[str]) -> None:
        """``_close_ended_store_requests``: preempted now, finished once drained."""
        for rid in preempted:
            self.delete_finished_stored_request(rid)
        for rid in finished | self.finished_store_req:
            if self.stored_requests.get(rid):
                self.finished_store_req.add(rid)
            else:
                self.finished_store_req.discard(rid)
                self.delete_finished_stored_request(rid)

    def take_completed_saves(self) -> dict[int, int]:
        out, self.completed_saves = self.completed_saves, {}
        return out

    def take_saved_offsets(self) -> dict[int, int]:
        """DEVIATION (readable pins): the offsets reported with the last completed saves."""
        out, self.saved_offsets = self.saved_offsets, {}
        return out

    # --- pressure gate (MW:548-569) -----------------------------------------------------

    def _mark_pressure(self, job: StoreJob) -> None:
        self.store_pressure_active = True
        if self._live(job):
            self.skip_store_requests.add(job.req_id)

    def _clear_pressure(self) -> None:
        self.store_pressure_active = False
        self.skip_store_requests.clear()

    # --- jobs --------------------------------------------------------------------------

    def run(self, n: int | None) -> list[tuple[StoreJob, int, str | None]]:
        """Run up to ``n`` queued jobs (all when None), FIFO. Returns (job, index of its first
        store-log entry, exception class name or None) per job."""
        out = []
        while self.queue and (n is None or len(out) < n):
            job = self.queue.popleft()
            first = len(self.store.log)
            err = None
            try:
                self.handle(job)
            except Exception as e:  # noqa: BLE001 - the thread logs and carries on
                err = type(e).__name__
            out.append((job, first, err))
        return out

    def handle(self, job: StoreJob) -> None:
        try:
            self._handle_request(job)
        finally:
            live = self.stored_requests.get(job.req_id)
            if live is not None:
                live.discard(job.store_job_id)
            jid = job.store_job_id
            assert jid is not None
            self.completed_saves[jid] = self.completed_saves.get(jid, 0) + 1
            self.saved_offsets[jid] = self.saved_offset.get(job.req_id, 0)

    def _handle_request(self, job: StoreJob) -> None:
        geo = self.geo
        token_len = round_down(job.token_len_chunk, geo.scheduler_block_size)
        if not self._live(job):
            return
        if self.store_pressure_active and job.req_id in self.skip_store_requests:
            return
        if not self._boundary_puts(job):
            return
        if token_len == 0:
            return
        if self.rules.monotone_saved_offset and token_len <= self.saved_offset.get(job.req_id, 0):
            return  # 0.34: ``checkpoint_len <= save_start``, nothing new to save
        self._normal_save(job, token_len)

    def _key(self, gid: int, job: StoreJob, boundary: int) -> tuple[Key, Tag]:
        h = self.geo.hash_block_size
        digest = bytes(job.block_hashes[boundary // h - 1])
        return (self.rank, gid, digest), (self.rank, gid, boundary, job.req_id)

    def _put(self, job: StoreJob, keys: list[Key], tags: list[Tag]) -> str:
        """Dedupe against the store, then put the missing keys in one batch.

        Returns "none" (everything already present: no put, the gate untouched), "ok", or
        "failed" (an exception or any negative code; -200 marks pressure)."""
        exists = self.store.batch_is_exist(keys)
        missing = [i for i, e in enumerate(exists) if e != 1]
        if not missing:
            return "none"
        try:
            codes = self.store.put([keys[i] for i in missing], [tags[i] for i in missing])
        except Exception:  # noqa: BLE001 - a store exception fails the batch closed
            return "failed"
        failed = {c for c in codes if c < 0}
        if NO_AVAILABLE_HANDLE in failed:
            self._mark_pressure(job)
        return "failed" if failed else "ok"

    def _boundary_puts(self, job: StoreJob) -> bool:
        """``_maybe_offload_boundary_states`` (MW:571-725)."""
        if not job.boundary_puts or not job.block_hashes:
            return True
        h = self.geo.hash_block_size
        keys: list[Key] = []
        tags: list[Tag] = []
        for gid, block_id, n in job.boundary_puts:
            if n == 0 or block_id == NULL_BLOCK_ID:
                continue
            assert n % h == 0
            if n // h - 1 >= len(job.block_hashes):
                continue
            k, t = self._key(gid, job, n)
            keys.append(k)
            tags.append(t)
        if not keys:
            return True
        result = self._put(job, keys, tags)
        if result == "ok":
            self._clear_pressure()
        return result != "failed"

    def _normal_save(self, job: StoreJob, token_len: int) -> None:
        """The positional save (``_handle_request`` over ``ChunkedTokenDatabase.process_tokens``
        with ``chunk_mask``): chunk ``first + i`` is written only where ``mask[i]``."""
        geo = self.geo
        start = self.saved_offset.get(job.req_id, 0)
        if start < job.pin_floor:
            return  # DEVIATION (readable pins): below the pins; the offset stays
        keys: list[Key] = []
        tags: list[Tag] = []
        assert token_len // geo.hash_block_size <= len(job.block_hashes)
        masks = store_mask(geo, token_len, start)
        missing = False  # an unavailable source block in a chunk the save should write
        for gid, bs in enumerate(geo.block_sizes):
            table = job.block_ids[gid]
            first, mask = cdiv(start, bs), masks[gid]
            stop = cdiv(token_len, bs) if mask is None else min(cdiv(token_len, bs),
                                                                 first + len(mask))
            for chunk in range(first, stop):
                if mask is not None and not mask[chunk - first]:
                    continue  # unreachable for a hit; every Mamba chunk
                end = min((chunk + 1) * bs, token_len)
                if chunk >= len(table) or table[chunk] == NULL_BLOCK_ID:
                    missing = True
                    continue
                k, t = self._key(gid, job, end)
                keys.append(k)
                tags.append(t)
        result = self._put(job, keys, tags) if keys else "none"
        complete = result != "failed"
        if self.rules.monotone_saved_offset:
            complete = complete and not missing  # 0.34: the missing range is retried
        if complete:
            self._record_saved(job, token_len)
        if result == "ok" and complete:
            self._clear_pressure()

    def _record_saved(self, job: StoreJob, token_len: int) -> None:
        """``_record_saved`` (0.33): the job's length; ``_record_saved_offset`` (0.34): never
        below the offset already recorded."""
        if self._live(job):
            if self.rules.monotone_saved_offset:
                token_len = max(self.saved_offset.get(job.req_id, 0), token_len)
            self.saved_offset[job.req_id] = token_len

    # --- observation -------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"pressure": self.store_pressure_active,
                "skipped": sorted(self.skip_store_requests),
                "offsets": {r: n for r, n in sorted(self.saved_offset.items())}}
