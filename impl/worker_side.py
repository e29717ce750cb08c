"""Worker role: execute one step's loads and store jobs against the KV cache tensors.

Semantics: ``tailproof.reference.connector.worker`` (store jobs; loads have no reference model,
their bytes are checked by the ``impl`` adapter). Mirrors vLLM 0.33's ``MooncakeStoreWorker``
(``KVCacheStoreSendingThread._handle_request``, ``KVCacheStoreRecvingThread._handle_request``,
``_close_ended_store_requests``), executed synchronously inside the step.
Written independently of ``tailproof.reference.connector.worker`` on purpose (not shared):
the corpus compares the two op by op, and both with vLLM's own code on ``vllm-mooncake``;
a shared body would compare a function with itself. Pure arithmetic is shared instead
(``spec.arithmetic``). Per step:

* loads (``start_load_kv``): get every needed key into a staging buffer; only when *all* keys
  of a request arrived intact (``Outcome.ok``) are they scattered into the request's blocks.
  An asynchronous load (the default) is then reported finished, a failed one also in
  ``failed_recving``; a synchronous load's failure is reported through
  ``get_block_ids_with_load_errors`` (single-group models only: vLLM cannot map block ids back
  to requests with several KV cache groups). Either way vLLM recomputes -- fail closed, a
  failed load is never served;
* store jobs (``wait_for_save``, after the step's forward): first synchronise on the step's
  device work (the CoW copies of this step fill the tail blocks the job reads), then boundary
  puts, then the normal save from this rank's saved offset; keys already stored are skipped;
  every job is reported done exactly once (``TailproofWorkerMeta``) whatever happened, so the
  scheduler can drop its pins;
* pressure gate: a put answered STORE_FULL marks the store under pressure and the request
  skipped; later jobs of skipped requests put nothing until any fully successful put batch
  clears the gate (Mooncake's ``_store_pressure_active`` / ``_skip_store_requests``);
* values (``value_format``): every put writes a header (fingerprint, key, length, checksum,
  optional MAC) in front of the block's bytes in the staging buffer; every get verifies it
  before anything is scattered. A value that fails is a failed load, counted by kind
  (``verify_fail_<kind>``) and removed from the store, so the next save rewrites it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.fingerprint import Fingerprint, geometry_fingerprint
from tailproof.impl.keys import INITIAL_EPOCH, KeySpace
from tailproof.impl.kv_layout import KVLayout
from tailproof.impl.meta import LoadJob, StoreJob, TailproofMeta, TailproofWorkerMeta
from tailproof.impl.metrics import WorkerMetrics
from tailproof.impl.stores import Status, Store
from tailproof.impl.value_format import HEADER_BYTES, ValueCodec, slot_nbytes
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
    """The connector's worker role (one per GPU worker / tensor-parallel rank)."""

    def __init__(
        self, settings: Settings, geo: StoreGeometry, store: Store, rank: int, world: int,
        coord: Any = None, metrics: WorkerMetrics | None = None,
        fingerprint: Fingerprint | None = None, secret: bytes | None = None, tp_size: int = 1,
    ):
        fp = fingerprint or geometry_fingerprint(geo)
        self.keys = KeySpace(settings.namespace, fp.digest, tp_size)
        self.codec = ValueCodec(fp.raw, secret)
        self.settings = settings
        self.geo = geo
        self.store = store
        self.rank = rank
        self.world = world
        self.coord = coord
        self.metrics = metrics or WorkerMetrics()
        self.layout: KVLayout | None = None
        self.staging: torch.Tensor | None = None
        self.gate = PressureGate()
        self.saved_offset: dict[str, int] = {}  # per-rank normal-save resume point
        self.queue: deque[StoreJob] = deque()
        self.stored_requests: dict[str, set[int]] = {}  # live store jobs per request
        self.finished_store_req: set[str] = set()  # finished requests whose jobs are still queued
        self.completed_saves: dict[int, int] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_error_blocks: set[int] = set()

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(
        self, kv_caches: dict[str, Any], layer_groups: Sequence[Sequence[str]]
    ) -> None:
        """Index the KV tensors per store group and allocate the staging buffer."""
        self.layout = KVLayout(kv_caches, layer_groups, self.geo.num_blocks)
        need = max([0, *map(slot_nbytes, self.layout.block_nbytes)])
        size = max(self.settings.staging_buffer_bytes, need)
        pin = self.layout.device.type == "cuda"
        self.staging = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.store.register_buffer(self.staging)

    def close(self) -> None:
        if self.staging is not None:
            self.store.unregister_buffer(self.staging)
            self.staging = None

    def key(self, group: int, block_hash: bytes, epoch: str = INITIAL_EPOCH) -> str:
        return self.keys.key(self.rank, group, block_hash, epoch)

    def _slot(self, group: int) -> int:
        """Bytes of one stored value of ``group``: header + the block's bytes."""
        assert self.layout is not None
        return slot_nbytes(self.layout.block_nbytes[group])

    def _per_batch(self, group: int) -> int:
        assert self.layout is not None and self.staging is not None
        bb = self._slot(group)
        return max(1, min(self.settings.put_batch_size, self.staging.numel() // bb))

    # ------------------------------------------------------------------ loads

    def start_load(self, meta: TailproofMeta) -> dict[str, bool]:
        """Run this step's loads; returns request id -> whether its load fully succeeded."""
        results: dict[str, bool] = {}
        for job in meta.loads:
            t0 = time.perf_counter()
            try:
                ok = self._load(job)
            except Exception:  # fail closed: an unexpected error is a failed load, not a crash
                logger.exception("load of %s failed", job.req_id)
                ok = False
            self.metrics.c.sample("job_latency_s", time.perf_counter() - t0)
            if job.is_async:
                self.finished_recving.add(job.req_id)
                if not ok:
                    self.failed_recving.add(job.req_id)
            if not ok:
                self.metrics.c.inc("load_failures")
                if not job.is_async:
                    self.load_error_blocks.update(self._target_blocks(job))
            results[job.req_id] = ok
        return results

    def _target_blocks(self, job: LoadJob) -> list[int]:
        """The request's blocks the load would fill (its private, freshly allocated blocks past
        the block-aligned local hit): reported by id when a synchronous load fails."""
        start = job.vllm_cached_tokens // self.geo.lcm_block_size * self.geo.lcm_block_size
        return [b for g, bs in enumerate(self.geo.block_sizes)
                for b in job.block_ids[g][start // bs :] if b != NULL_BLOCK_ID]

    def load_plan(self, job: LoadJob) -> list[tuple[int, int, bytes]]:
        """(group, block id, key hash) of every block the load fills."""
        geo = self.geo
        h = geo.hash_block_size
        start = job.vllm_cached_tokens // geo.lcm_block_size * geo.lcm_block_size
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
        assert self.layout is not None and self.staging is not None
        try:
            plan = self.load_plan(job)
        except (IndexError, KeyError) as exc:
            logger.warning("load plan of %s failed: %s", job.req_id, exc)
            return False
        if any(b == NULL_BLOCK_ID for _, b, _ in plan):
            return False
        fetched: list[tuple[int, list[int], torch.Tensor]] = []
        for g in range(self.geo.num_groups):
            items = [(b, hh) for gg, b, hh in plan if gg == g]
            bb = self._slot(g)
            step = self._per_batch(g)
            for i in range(0, len(items), step):
                chunk = items[i : i + step]
                region = self.staging[: len(chunk) * bb]
                bufs = [region[j * bb : (j + 1) * bb] for j in range(len(chunk))]
                keys = [self.key(g, hh, job.epoch) for _, hh in chunk]
                outs = self.store.get_batch(keys, bufs)
                self.metrics.record_batch("get", outs, sum(o.nbytes for o in outs if o.ok))
                if not all(o.ok for o in outs) or not self._verified(keys, bufs):
                    return False
                # Keep a copy of the payloads: the staging buffer is reused by the next batch.
                payload = region.view(len(chunk), bb)[:, HEADER_BYTES:].clone()
                fetched.append((g, [b for b, _ in chunk], payload))
        for g, ids, data in fetched:
            self.layout.scatter(g, ids, data)
        return True

    def _verified(self, keys: list[str], slots: list[torch.Tensor]) -> bool:
        """Verify every loaded value; count and remove the bad ones (the next save rewrites
        them, so one bad value cannot fail its prefix forever)."""
        bad = []
        for key, slot in zip(keys, slots, strict=True):
            kind = self.codec.verify(key, slot)
            if kind is not None:
                self.metrics.c.inc(f"verify_fail_{kind}")
                bad.append(key)
        if bad:
            logger.warning("rejected %d stored value(s) failing verification, e.g. %s",
                           len(bad), bad[0])
            self.metrics.c.inc("verify_removed", self.store.remove(bad))
        return not bad

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, meta: TailproofMeta) -> None:
        """Run this step's store jobs (after its forward), then retire ended requests."""
        if self.settings.can_put:
            for job in meta.stores:
                self.add_request(job)
        if self.queue:
            self._sync_device()
        self.run()
        self.close_ended_store_requests(meta.finished_req_ids, meta.preempted_req_ids)

    def add_request(self, job: StoreJob) -> None:
        """Register a job as live for its request and queue it (``add_request``)."""
        self.stored_requests.setdefault(job.req_id, set()).add(job.store_job_id)
        self.queue.append(job)

    def run(self, n: int | None = None) -> list[tuple[StoreJob, str | None]]:
        """Run up to ``n`` queued jobs (all when None), FIFO; each is reported exactly once.
        Returns (job, exception class name or None) per job run."""
        done: list[tuple[StoreJob, str | None]] = []
        while self.queue and (n is None or len(done) < n):
            job = self.queue.popleft()
            t0 = time.perf_counter()
            err = None
            try:
                self._handle_request(job)
            except Exception as exc:  # a store bug must not wedge the pins: report the job
                logger.exception("store job %d of %s failed", job.store_job_id, job.req_id)
                self.metrics.c.inc("job_errors")
                err = type(exc).__name__
            finally:
                live = self.stored_requests.get(job.req_id)
                if live is not None:
                    live.discard(job.store_job_id)
                jid = job.store_job_id
                self.completed_saves[jid] = self.completed_saves.get(jid, 0) + 1
                self.metrics.c.sample("job_latency_s", time.perf_counter() - t0)
            done.append((job, err))
        self.metrics.c.set("pressure_active", int(self.gate.store_pressure_active))
        return done

    def close_ended_store_requests(self, finished: set[str], preempted: set[str]) -> None:
        """Retire request state: preempted now (their queued jobs become not live), finished
        once their queued jobs drained (``_close_ended_store_requests``)."""
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

    def _sync_device(self) -> None:
        """Wait for this step's device work (forward, CoW copies) before reading blocks."""
        if self.layout is not None and self.layout.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    def _handle_request(self, job: StoreJob) -> None:
        lcm = self.geo.lcm_block_size
        token_len = job.token_len_chunk // lcm * lcm
        if not self._live(job):
            self.metrics.c.inc("jobs_not_live")
            return
        if self.gate.should_skip(job.req_id):
            self.metrics.c.inc("jobs_skipped_pressure")
            return
        if not self._boundary_puts(job):
            return  # a failed boundary put also skips this job's normal save
        if token_len == 0:
            return
        start = self.saved_offset.get(job.req_id, 0)
        items: list[tuple[int, int, bytes]] = []
        h = self.geo.hash_block_size
        for g, bs in enumerate(self.geo.block_sizes):
            if self.geo.is_mamba[g]:
                continue  # Mamba states are stored only at exact hand-off boundaries
            table = job.block_ids[g]
            for idx in range(cdiv(start, bs), cdiv(token_len, bs)):
                end = min((idx + 1) * bs, token_len)
                if idx >= len(table) or table[idx] == NULL_BLOCK_ID:
                    continue
                items.append((g, table[idx], job.block_hashes[end // h - 1]))
        result = self._put(job, items)
        if result != "failed" and self._live(job):
            self.saved_offset[job.req_id] = token_len
        if result == "ok":
            self.gate.clear()

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
            self.gate.clear()
        return result != "failed"

    def _put(self, job: StoreJob, items: list[tuple[int, int, bytes]]) -> str:
        """Put the keys of ``items`` the store lacks, in order, as one batch (split only to fit
        the staging buffer). "none": nothing was missing; "ok": all stored; "failed": any key
        failed (STORE_FULL marks the pressure gate)."""
        assert self.layout is not None and self.staging is not None
        if not items:
            return "none"
        keys = [self.key(g, hh, job.epoch) for g, _, hh in items]
        present = self.store.exists(keys)
        todo = [(it, k) for it, k, p in zip(items, keys, present, strict=True) if not p]
        if not todo:
            return "none"
        sizes = [self._slot(g) for (g, _, _), _ in todo]
        cap = self.staging.numel()
        i = 0
        while i < len(todo):
            j, used = i, 0
            while j < len(todo) and j - i < self.settings.put_batch_size and (
                    j == i or used + sizes[j] <= cap):
                used += sizes[j]
                j += 1
            outs = self._put_chunk(todo[i:j], sizes[i:j])
            self.metrics.record_batch("put", outs, sum(o.nbytes for o in outs if o.ok))
            if not all(o.saved for o in outs):
                if any(o.status is Status.STORE_FULL for o in outs):
                    self.gate.store_pressure_active = True
                    if self._live(job):
                        self.gate.skip_store_requests.add(job.req_id)
                return "failed"
            i = j
        return "ok"

    def _put_chunk(self, todo: list[tuple[tuple[int, int, bytes], str]],
                   sizes: list[int]) -> list[Any]:
        """Gather the blocks into the staging buffer behind room for their headers (item order
        kept), seal every value (``ValueCodec.seal``) and put them."""
        assert self.layout is not None and self.staging is not None
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + n)
        by_group: dict[int, list[int]] = {}
        for idx, ((g, _, _), _) in enumerate(todo):
            by_group.setdefault(g, []).append(idx)
        for g, idxs in by_group.items():
            rows = self.layout.gather(g, [todo[i][0][1] for i in idxs])
            if idxs == list(range(idxs[0], idxs[0] + len(idxs))):
                # Consecutive items (the usual case): one device-to-host copy.
                slots = self.staging[offs[idxs[0]] : offs[idxs[-1] + 1]].view(len(idxs), -1)
                slots[:, HEADER_BYTES:].copy_(rows)
                continue
            for r, i in enumerate(idxs):
                self.staging[offs[i] + HEADER_BYTES : offs[i + 1]].copy_(rows[r])
        bufs = [self.staging[offs[i] : offs[i + 1]] for i in range(len(todo))]
        for (_, key), buf in zip(todo, bufs, strict=True):
            self.codec.seal(key, buf)
        return self.store.put_batch([k for _, k in todo], bufs)

    # ------------------------------------------------------------------ reports

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call (failed ⊆ finished)."""
        done, failed = self.finished_recving, self.failed_recving
        self.finished_recving, self.failed_recving = set(), set()
        return done, failed

    def take_load_error_blocks(self) -> set[int]:
        out, self.load_error_blocks = self.load_error_blocks, set()
        return out

    def build_connector_worker_meta(self) -> TailproofWorkerMeta | None:
        if not self.completed_saves:
            return None
        out, self.completed_saves = self.completed_saves, {}
        return TailproofWorkerMeta(completed_saves=out)
