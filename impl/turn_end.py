"""EXTENSION, not vLLM 0.33: turn-end checkpoints, decode-time block boundaries, lookup wait.

The rules of ``docs/reuse.md`` (rules 1-7), restated independently of
``tailproof.reference.connector.turn_end`` (the corpus compares the two). Off unless
``Settings`` turns them on. :class:`TurnEndCheckpoints` is a mixin of
``tailproof.impl.scheduler_side.SchedulerSide``, which calls in at these points and is
otherwise vLLM 0.33's Mooncake scheduler:

- per step, after the step's jobs are built and pinned (``build_connector_meta``):
  :meth:`TurnEndCheckpoints._take_snapshots` (rule 1; the copies are the workers', rule 2,
  ``WorkerSide.copy_snapshots``), with the step's ends from ``_step_ends``; the decode
  boundaries of a job get their attention puts from ``_decode_boundary_puts`` when it is
  pinned (rule 5);
- at preemption and finish: ``release_snapshot`` (rule 4); at finish, before the core frees
  the request's blocks: ``finish_turn`` (rule 3), or already in the step whose snapshot is the
  request's last boundary before a finish by length (rule 3b);
- with ``checkpoint_lookup_wait`` (rule 7): every pinned job's Mamba keys are remembered
  (``_register_inflight``) until its pins are released (``_release_inflight``), and a lookup
  extending one of them past its hit waits (``_awaits_inflight``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import BoundaryPut, SaveDraft, Snapshot, StoreJob, TailproofMeta
from tailproof.impl.metrics import SchedulerMetrics
from tailproof.spec.arithmetic import (
    NULL_BLOCK_ID,
    running_state_index,
    snapshot_due,
    turn_end_attention_puts,
)

logger = logging.getLogger(__name__)


class TurnEndCheckpoints:
    """The turn-end part of ``SchedulerSide`` (a mixin: its state lives on the scheduler side,
    which supplies the attributes annotated here and ``seal``)."""

    settings: Settings
    geo: StoreGeometry
    pool: Any
    metrics: SchedulerMetrics
    held: dict[int, tuple[list[int], int]]
    request_trackers: dict[str, Any]
    unfinished_requests: dict[str, tuple[Any, tuple[list[int], ...]]]
    _eagle_margins: tuple[int, ...]
    seal: Callable[..., StoreJob | None]  # SchedulerSide.seal

    def _init_turn_end(self, settings: Settings, geo: StoreGeometry) -> None:
        """The extension's per-engine state (empty; nothing runs while it is off)."""
        # Reuse extension (docs/reuse.md): rid -> (snapshot block per Mamba store group, in
        # store order; the boundary their content is the state of).
        self.snapshot_slots: dict[str, tuple[list[int], int]] = {}
        self.finished_turn_ends: dict[str, StoreJob] = {}
        self._mamba_groups = tuple(g for g in range(geo.num_groups) if geo.is_mamba[g])
        self._step_end: dict[str, int] = {}  # rid -> real tokens computed after this step
        self.reuse_disabled = False  # set once if a step shows what the extension refuses
        # Lookup wait (docs/reuse.md, rule 7): key hash of a Mamba boundary an in-flight job
        # puts -> [boundary, jobs putting it]; job -> those hashes.
        self._inflight: dict[bytes, list[int]] = {}
        self._job_keys: dict[int, list[bytes]] = {}
        self._track_inflight = settings.reuse_extension and settings.checkpoint_lookup_wait
        self._reuse_reasons_logged: set[str] = set()
        if settings.reuse_extension and settings.is_consumer:
            logger.info("TailproofConnector: the reuse extension is on but the role is a "
                        "consumer, which stores nothing: no snapshots, turn-end, decode-"
                        "boundary or junction checkpoints (docs/reuse.md)")

    def _reuse_skipped(self, counter: str, why: str) -> None:
        """Count a checkpoint the extension would take but cannot, and say why once per
        counter (``snapshots_skipped``, ``snapshots_no_source``, ``turn_end_not_flushed``)."""
        self.metrics.c.inc(counter)
        if counter not in self._reuse_reasons_logged:
            self._reuse_reasons_logged.add(counter)
            logger.info("TailproofConnector: a turn-end checkpoint was not taken: %s (counted "
                        "as %s; logged once)", why, counter)

    def _awaits_inflight(self, request: Any, hit: int) -> bool:
        """Rule 7: whether ``request``'s prompt extends, past ``hit``, a Mamba boundary an
        in-flight store job is putting -- a turn sent as its predecessor finished would
        otherwise look up before the flush landed and resume at ck(P)."""
        h = self.geo.hash_block_size
        hashes = request.block_hashes
        for hh, (b, _) in self._inflight.items():
            if hit < b < request.num_tokens and b // h <= len(hashes) and hashes[b // h - 1] == hh:
                return True
        return False

    def _register_inflight(self, s: StoreJob) -> None:
        """Remember the Mamba boundary keys of a pinned job until its pins are released."""
        if s.store_job_id not in self.held:
            return  # nothing pinned, nothing released later: never a key to wait on
        h, mamba = self.geo.hash_block_size, self.geo.is_mamba
        keys = []
        for p in s.boundary_puts:
            if mamba[p.group_id] and 0 < p.num_tokens // h <= len(s.block_hashes):
                hh = s.block_hashes[p.num_tokens // h - 1]
                ent = self._inflight.setdefault(hh, [p.num_tokens, 0])
                ent[1] += 1
                keys.append(hh)
        if keys:
            self._job_keys[s.store_job_id] = keys

    def _release_inflight(self, job: int) -> None:
        # Also in reference.connector.turn_end (rule 7's in-flight keys): impl and the reference
        # must not share a body (docs/architecture.md).
        for hh in self._job_keys.pop(job, ()):
            ent = self._inflight[hh]
            ent[1] -= 1
            if ent[1] == 0:
                del self._inflight[hh]

    def _check_step_supported(self, so: Any) -> None:
        """Disable the extension (one logged error) when a step shows speculative tokens: the
        config check refuses speculative decoding, this catches what it could not see; a
        snapshot of a step that does not end on a known boundary would store wrong bytes."""
        if not getattr(so, "scheduled_spec_decode_tokens", None):
            return
        logger.error("TailproofConnector: a step scheduled speculative tokens; turn-end "
                     "checkpoints and decode boundary saves are disabled (docs/reuse.md, "
                     "Limits)")
        self.reuse_disabled = True
        for rid in list(self.snapshot_slots):
            self.release_snapshot(rid)

    def _step_ends(self, so: Any) -> dict[str, int]:
        """Per scheduled request, in vLLM's order (new, then ``CachedRequestData``: running,
        then resumed): computed tokens at schedule time + the step's real tokens, i.e. where
        this step's forward leaves the request. Every scheduled non-draft token is real,
        including the placeholder of a token still being sampled under async scheduling
        (vLLM 0.33's default): not ``num_tokens - computed``, which misses that one."""
        out: dict[str, int] = {}
        sched = so.num_scheduled_tokens
        drafts = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        cached = so.scheduled_cached_reqs
        rows = [(nr.req_id, nr.num_computed_tokens) for nr in so.scheduled_new_reqs]
        rows += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for rid, computed in rows:
            if rid in self.unfinished_requests:
                out[rid] = computed + sched[rid] - len(drafts.get(rid, ()))
        return out

    def _take_snapshots(self, so: Any, state: Any, meta: TailproofMeta) -> None:
        """Rule 1: every request whose step ends on a hash boundary past ck(P) gets its running
        Mamba state copied into its snapshot blocks (taken now if it has none and the bounds
        allow; otherwise skipped, counted)."""
        geo = self.geo
        if not self._mamba_groups:
            return
        h = geo.hash_block_size
        for rid, n in self._step_end.items():
            req = self.unfinished_requests[rid][0]
            if not snapshot_due(n, req.num_prompt_tokens, h, geo.use_eagle):
                continue
            srcs = self._snapshot_sources(state.get_block_ids(rid), n)
            if srcs is None:
                self._reuse_skipped("snapshots_no_source", "the running Mamba state block is "
                                    "missing or the null block")
                continue
            final = n == self._final_boundary(req)
            slots = self._snapshot_blocks(rid, final)
            if slots is None:
                self._reuse_skipped("snapshots_skipped", "checkpoint_slots requests hold "
                                    "snapshot blocks, or checkpoint_reserve_blocks would not "
                                    "stay free")
                continue
            self.snapshot_slots[rid] = (slots, n)
            meta.snapshots += [Snapshot(rid, g, src, slot, n)
                               for g, src, slot in zip(self._mamba_groups, srcs, slots,
                                                       strict=True)]
            self.metrics.c.inc("snapshots_taken")
            t = self.request_trackers.get(rid)
            if n == self._final_boundary(req) and t is not None and self.settings.is_producer:
                # Rule 3b: the last boundary before a finish by length is flushed now (the
                # job runs after this step's copy), not at finish: a next turn sent as soon as
                # this one ends then finds it stored.
                table = state.get_block_ids(rid)
                ids = tuple([list(table[g]) for g in geo.core_group_ids])
                meta.stores.append(self._checkpoint_job(req, slots, n, ids, t.num_saved_tokens, n))
                self.release_snapshot(rid)

    def _snapshot_sources(self, table: Any, n: int) -> list[int] | None:
        """The running state block of every Mamba group after ``n`` tokens (None when any is
        missing or the null block: never a snapshot of the null block)."""
        if table is None:
            return None
        out: list[int] = []
        for g in self._mamba_groups:
            ids = table[self.geo.core_group_ids[g]]
            i = running_state_index(n, self.geo.block_sizes[g])
            if i >= len(ids) or ids[i] == NULL_BLOCK_ID:
                return None
            out.append(ids[i])
        return out

    def _snapshot_blocks(self, rid: str, final: bool) -> list[int] | None:
        """The request's snapshot blocks (overwritten), or new ones from vLLM's pool
        (``BlockPool.get_new_blocks``, one reference held by the connector) if fewer than
        ``checkpoint_slots`` requests hold some and the pool keeps ``checkpoint_reserve_blocks``
        free blocks; else None. A ``final`` snapshot (rule 3b: flushed in this same step, so
        its blocks are held one step, by the job) needs only free blocks and no slot."""
        held = self.snapshot_slots.get(rid)
        if held is not None:
            return held[0]
        k = len(self._mamba_groups)
        if not final and len(self.snapshot_slots) >= self.settings.checkpoint_slots:
            return None
        reserve = 0 if final else self.settings.checkpoint_reserve_blocks
        if self.pool.get_num_free_blocks() - k < reserve:
            return None
        return [b.block_id for b in self.pool.get_new_blocks(k)]

    def release_snapshot(self, rid: str) -> None:
        """Drop the connector's reference on ``rid``'s snapshot blocks (if it holds any)."""
        held = self.snapshot_slots.pop(rid, None)
        if held is not None:
            blocks = self.pool.blocks
            self.pool.free_blocks([blocks[b] for b in held[0]])

    def finish_turn(self, request: Any, block_ids: tuple[list[int], ...]) -> StoreJob | None:
        """Rule 3, at finish (``request_finished_all_groups``, before the core frees the
        request's blocks; ``block_ids`` per core group): store the last snapshot once -- the
        attention KV up to its boundary, then the snapshot blocks under its key. The job pins
        its blocks now, then the connector's own reference on the slots is dropped; the job is
        emitted with the next meta. Without a flush the slots are just released."""
        rid = request.request_id
        held = self.snapshot_slots.get(rid)
        if held is None:
            return None
        slots, b = held
        t = self.request_trackers.get(rid)
        geo = self.geo
        job = None
        if (self.settings.is_producer and t is not None and b <= request.num_computed_tokens
                and b // geo.hash_block_size <= len(request.block_hashes)):
            ids = tuple([list(block_ids[g]) for g in geo.core_group_ids])
            job = self._checkpoint_job(request, slots, b, ids, t.num_saved_tokens,
                                     request.num_computed_tokens)
            if rid in self.finished_turn_ends:
                raise AssertionError(f"{rid}: second turn-end flush")
            self.finished_turn_ends[rid] = job  # sealed now: this epoch's KV
        else:
            self._reuse_skipped("turn_end_not_flushed", "at finish the snapshot lies past the "
                                "computed tokens or the hashes, or the request has no tracker")
        self.release_snapshot(rid)
        return job

    def _checkpoint_job(self, request: Any, slots: list[int], b: int,
                        ids: tuple[list[int], ...], saved_tokens: int, completed: int,
                        metric: str = "turn_end_jobs") -> StoreJob:
        """The sealed job storing a snapshot at ``b`` (a turn end or a junction): the attention
        KV from ``saved_tokens`` up to ``b``, then the snapshot blocks under ``b``'s key; its
        pins are taken now, outside the pin budget."""
        geo = self.geo
        attn = turn_end_attention_puts(
            boundary=b, saved_tokens=saved_tokens, completed_token_len=completed,
            num_hashes=len(request.block_hashes), block_ids=ids, block_sizes=geo.block_sizes,
            is_mamba=geo.is_mamba, eagle_margins=self._eagle_margins,
            hash_block_size=geo.hash_block_size)
        puts = [BoundaryPut(*p) for p in attn]
        puts += [BoundaryPut(g, slot, b) for g, slot in zip(self._mamba_groups, slots,
                                                             strict=True)]
        job = self.seal(SaveDraft(
            req_id=request.request_id, token_len_chunk=0, block_ids=ids,
            block_hashes=list(request.block_hashes), boundary_puts=puts,
            completed_token_len=completed, num_prompt_tokens=request.num_prompt_tokens),
            budgeted=False)
        assert job is not None  # outside the budget: always sealed
        self.metrics.c.inc(metric)
        return job

    def _final_boundary(self, request: Any) -> int:
        """The last hash boundary a request can compute before it finishes by length
        (``max_tokens``): its last snapshot, known in advance; -1 when the request does not
        say (a request-like object without ``max_tokens``)."""
        max_tokens = getattr(request, "max_tokens", None)
        if not isinstance(max_tokens, int):
            return -1
        h = self.geo.hash_block_size
        return (request.num_prompt_tokens + max_tokens - 1) // h * h

    def _decode_boundary_puts(self, s: SaveDraft) -> list[BoundaryPut]:
        """Rule 5: the attention blocks up to each accepted decode boundary of ``s``
        (deduplicated, in boundary order), over the job's current block table."""
        t = self.request_trackers.get(s.req_id)
        if t is None:
            return []
        geo = self.geo
        seen: dict[BoundaryPut, None] = {}
        for b in s.decode_boundaries:
            for p in turn_end_attention_puts(
                    boundary=b, saved_tokens=t.num_saved_tokens,
                    completed_token_len=s.completed_token_len,
                    num_hashes=len(s.block_hashes), block_ids=s.block_ids,
                    block_sizes=geo.block_sizes, is_mamba=geo.is_mamba,
                    eagle_margins=self._eagle_margins, hash_block_size=geo.hash_block_size):
                seen[BoundaryPut(*p)] = None
        return list(seen)
