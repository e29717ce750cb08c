"""EXTENSION, not vLLM 0.33: turn-end checkpoints, decode-time block boundaries, lookup wait.

The rules of ``docs/reuse.md`` (rules 1-7), restated independently of
``tailproof.reference.connector.turn_end`` (the corpus compares the two). Off unless
``Settings`` turns them on. :class:`TurnEndCheckpoints` and :class:`InflightKeys` are
collaborators of ``tailproof.impl.extension.ReuseExtension``, which the scheduler role
(``scheduler_side.SchedulerSide``, otherwise vLLM 0.33's Mooncake scheduler) calls at named
points; they share no state with it and reach it only through the ``seal`` they are given:

- per step, after the step's jobs are sealed: :meth:`TurnEndCheckpoints.take_snapshots`
  (rule 1; the copies are the workers', rule 2, ``WorkerSide.copy_snapshots``), over the step
  ends of :func:`step_ends`; the decode boundaries of a draft get their attention puts from
  :meth:`TurnEndCheckpoints.decode_boundary_puts` when it is sealed (rule 5);
- at preemption and finish: :meth:`TurnEndCheckpoints.release` (rule 4); at finish, before the
  core frees the request's blocks: :meth:`TurnEndCheckpoints.finish_turn` (rule 3), or already
  in the step whose snapshot is the request's last boundary before a finish by length (3b);
- with ``checkpoint_lookup_wait`` (rule 7): every pinned job's Mamba keys are remembered
  (:meth:`InflightKeys.register`) until its pins are released (:meth:`InflightKeys.release`),
  and a lookup extending one of them past its hit waits (:meth:`InflightKeys.waits`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
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

# ``SchedulerSide.seal``: a draft -> its sealed job (the extension's jobs pass budgeted=False).
Seal = Callable[..., StoreJob | None]


def step_ends(so: Any, live: Mapping[str, Any]) -> dict[str, int]:
    """Per scheduled request of ``live``, in vLLM's order (new, then ``CachedRequestData``:
    running, then resumed): computed tokens at schedule time + the step's real tokens, i.e.
    where this step's forward leaves the request. Every scheduled non-draft token is real,
    including the placeholder of a token still being sampled under async scheduling (vLLM
    0.33's default): not ``num_tokens - computed``, which misses that one."""
    out: dict[str, int] = {}
    sched = so.num_scheduled_tokens
    drafts = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    cached = so.scheduled_cached_reqs
    rows = [(nr.req_id, nr.num_computed_tokens) for nr in so.scheduled_new_reqs]
    rows += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
    for rid, computed in rows:
        if rid in live:
            out[rid] = computed + sched[rid] - len(drafts.get(rid, ()))
    return out


def snapshot_sources(geo: StoreGeometry, mamba_groups: tuple[int, ...], table: Any,
                     n: int) -> list[int] | None:
    """The running state block of every Mamba group after ``n`` tokens (None when any is
    missing or the null block: never a snapshot of the null block)."""
    if table is None:
        return None
    out: list[int] = []
    for g in mamba_groups:
        ids = table[geo.core_group_ids[g]]
        i = running_state_index(n, geo.block_sizes[g])
        if i >= len(ids) or ids[i] == NULL_BLOCK_ID:
            return None
        out.append(ids[i])
    return out


def checkpoint_draft(geo: StoreGeometry, mamba_groups: tuple[int, ...],
                     eagle_margins: tuple[int, ...], request: Any, slots: list[int], b: int,
                     ids: tuple[list[int], ...], saved_tokens: int,
                     completed: int) -> SaveDraft:
    """The draft storing a snapshot at ``b`` (a turn end or a junction): the attention KV from
    ``saved_tokens`` up to ``b``, then the snapshot blocks under ``b``'s key."""
    attn = turn_end_attention_puts(
        boundary=b, saved_tokens=saved_tokens, completed_token_len=completed,
        num_hashes=len(request.block_hashes), block_ids=ids, block_sizes=geo.block_sizes,
        is_mamba=geo.is_mamba, eagle_margins=eagle_margins,
        hash_block_size=geo.hash_block_size)
    puts = [BoundaryPut(*p) for p in attn]
    puts += [BoundaryPut(g, slot, b) for g, slot in zip(mamba_groups, slots, strict=True)]
    return SaveDraft(req_id=request.request_id, token_len_chunk=0, block_ids=ids,
                     block_hashes=list(request.block_hashes), boundary_puts=puts,
                     completed_token_len=completed, num_prompt_tokens=request.num_prompt_tokens)


class InflightKeys:
    """Rule 7's in-flight keys: the key hash of a Mamba boundary a pinned job puts ->
    [boundary, jobs putting it]; job -> those hashes."""

    def __init__(self, geo: StoreGeometry) -> None:
        self.geo = geo
        self.keys: dict[bytes, list[int]] = {}
        self.job_keys: dict[int, list[bytes]] = {}

    def waits(self, request: Any, hit: int) -> bool:
        """Whether ``request``'s prompt extends, past ``hit``, a Mamba boundary an in-flight
        store job is putting -- a turn sent as its predecessor finished would otherwise look
        up before the flush landed and resume at ck(P)."""
        h = self.geo.hash_block_size
        hashes = request.block_hashes
        for hh, (b, _) in self.keys.items():
            if hit < b < request.num_tokens and b // h <= len(hashes) and hashes[b // h - 1] == hh:
                return True
        return False

    def register(self, job: StoreJob) -> None:
        """Remember the Mamba boundary keys of a pinned job until its pins are released."""
        h, mamba = self.geo.hash_block_size, self.geo.is_mamba
        keys = []
        for p in job.boundary_puts:
            if mamba[p.group_id] and 0 < p.num_tokens // h <= len(job.block_hashes):
                hh = job.block_hashes[p.num_tokens // h - 1]
                ent = self.keys.setdefault(hh, [p.num_tokens, 0])
                ent[1] += 1
                keys.append(hh)
        if keys:
            self.job_keys[job.store_job_id] = keys

    def release(self, job: int) -> None:
        # Also in reference.connector.turn_end (rule 7's in-flight keys): impl and the reference
        # must not share a body (docs/architecture.md).
        for hh in self.job_keys.pop(job, ()):
            ent = self.keys[hh]
            ent[1] -= 1
            if ent[1] == 0:
                del self.keys[hh]


class TurnEndCheckpoints:
    """Rules 1-5: snapshot blocks, the step's copies, the turn-end and decode-boundary puts."""

    def __init__(self, settings: Settings, geo: StoreGeometry, metrics: SchedulerMetrics,
                 seal: Seal) -> None:
        self.settings = settings
        self.geo = geo
        self.metrics = metrics
        self.seal = seal
        self.pool: Any = None  # vLLM's BlockPool, bound with the scheduler side's
        # rid -> (snapshot block per Mamba store group, in store order; the boundary their
        # content is the state of).
        self.snapshot_slots: dict[str, tuple[list[int], int]] = {}
        self.finished: dict[str, StoreJob] = {}  # rule 3: sealed at finish, emitted next step
        self.mamba_groups = tuple(g for g in range(geo.num_groups) if geo.is_mamba[g])
        self.eagle_margins = tuple(geo.eagle_proof_margin(g) for g in range(geo.num_groups))
        self._reasons_logged: set[str] = set()

    def skipped(self, counter: str, why: str) -> None:
        """Count a checkpoint the extension would take but cannot, and say why once per
        counter (``snapshots_skipped``, ``snapshots_no_source``, ``turn_end_not_flushed``)."""
        self.metrics.c.inc(counter)
        if counter not in self._reasons_logged:
            self._reasons_logged.add(counter)
            logger.info("TailproofConnector: a turn-end checkpoint was not taken: %s (counted "
                        "as %s; logged once)", why, counter)

    def checkpoint_job(self, request: Any, slots: list[int], b: int,
                       ids: tuple[list[int], ...], saved_tokens: int, completed: int,
                       metric: str = "turn_end_jobs") -> StoreJob:
        """:func:`checkpoint_draft`, sealed now outside the pin budget, and counted."""
        job = self.seal(checkpoint_draft(self.geo, self.mamba_groups, self.eagle_margins,
                                         request, slots, b, ids, saved_tokens, completed),
                        budgeted=False)
        assert job is not None  # outside the budget: always sealed
        self.metrics.c.inc(metric)
        return job

    def take_snapshots(self, ends: Mapping[str, int], state: Any, meta: TailproofMeta,
                       requests: Mapping[str, Any], trackers: Mapping[str, Any]) -> None:
        """Rule 1: every request whose step ends on a hash boundary past ck(P) gets its running
        Mamba state copied into its snapshot blocks (taken now if it has none and the bounds
        allow; otherwise skipped, counted)."""
        geo = self.geo
        if not self.mamba_groups:
            return
        h = geo.hash_block_size
        for rid, n in ends.items():
            req = requests[rid][0]
            if not snapshot_due(n, req.num_prompt_tokens, h, geo.use_eagle):
                continue
            srcs = snapshot_sources(geo, self.mamba_groups, state.get_block_ids(rid), n)
            if srcs is None:
                self.skipped("snapshots_no_source", "the running Mamba state block is "
                             "missing or the null block")
                continue
            final = n == self.final_boundary(req)
            slots = self._snapshot_blocks(rid, final)
            if slots is None:
                self.skipped("snapshots_skipped", "checkpoint_slots requests hold snapshot "
                             "blocks, or checkpoint_reserve_blocks would not stay free")
                continue
            self.snapshot_slots[rid] = (slots, n)
            meta.snapshots += [Snapshot(rid, g, src, slot, n)
                               for g, src, slot in zip(self.mamba_groups, srcs, slots,
                                                       strict=True)]
            self.metrics.c.inc("snapshots_taken")
            t = trackers.get(rid)
            if final and t is not None and self.settings.is_producer:
                # Rule 3b: the last boundary before a finish by length is flushed now (the
                # job runs after this step's copy), not at finish: a next turn sent as soon as
                # this one ends then finds it stored.
                table = state.get_block_ids(rid)
                ids = tuple([list(table[g]) for g in geo.core_group_ids])
                meta.stores.append(self.checkpoint_job(req, slots, n, ids, t.num_saved_tokens, n))
                self.release(rid)

    def _snapshot_blocks(self, rid: str, final: bool) -> list[int] | None:
        """The request's snapshot blocks (overwritten), or new ones from vLLM's pool
        (``BlockPool.get_new_blocks``, one reference held by the connector) if fewer than
        ``checkpoint_slots`` requests hold some and the pool keeps ``checkpoint_reserve_blocks``
        free blocks; else None. A ``final`` snapshot (rule 3b: flushed in this same step, so
        its blocks are held one step, by the job) needs only free blocks and no slot."""
        held = self.snapshot_slots.get(rid)
        if held is not None:
            return held[0]
        k = len(self.mamba_groups)
        if not final and len(self.snapshot_slots) >= self.settings.checkpoint_slots:
            return None
        reserve = 0 if final else self.settings.checkpoint_reserve_blocks
        if self.pool.get_num_free_blocks() - k < reserve:
            return None
        return [b.block_id for b in self.pool.get_new_blocks(k)]

    def release(self, rid: str) -> None:
        """Drop the connector's reference on ``rid``'s snapshot blocks (if it holds any)."""
        held = self.snapshot_slots.pop(rid, None)
        if held is not None:
            blocks = self.pool.blocks
            self.pool.free_blocks([blocks[b] for b in held[0]])

    def finish_turn(self, request: Any, block_ids: tuple[list[int], ...],
                    t: Any) -> StoreJob | None:
        """Rule 3, at finish (``request_finished_all_groups``, before the core frees the
        request's blocks; ``block_ids`` per core group; ``t`` its tracker): store the last
        snapshot once -- the attention KV up to its boundary, then the snapshot blocks under
        its key. The job is sealed now (its pins, this epoch), then the connector's own
        reference on the slots is dropped; the job is emitted with the next meta. Without a
        flush the slots are just released."""
        rid = request.request_id
        held = self.snapshot_slots.get(rid)
        if held is None:
            return None
        slots, b = held
        geo = self.geo
        job = None
        if (self.settings.is_producer and t is not None and b <= request.num_computed_tokens
                and b // geo.hash_block_size <= len(request.block_hashes)):
            ids = tuple([list(block_ids[g]) for g in geo.core_group_ids])
            job = self.checkpoint_job(request, slots, b, ids, t.num_saved_tokens,
                                      request.num_computed_tokens)
            if rid in self.finished:
                raise AssertionError(f"{rid}: second turn-end flush")
            self.finished[rid] = job
        else:
            self.skipped("turn_end_not_flushed", "at finish the snapshot lies past the "
                         "computed tokens or the hashes, or the request has no tracker")
        self.release(rid)
        return job

    def final_boundary(self, request: Any) -> int:
        """The last hash boundary a request can compute before it finishes by length
        (``max_tokens``): its last snapshot, known in advance; -1 when the request does not
        say (a request-like object without ``max_tokens``)."""
        max_tokens = getattr(request, "max_tokens", None)
        if not isinstance(max_tokens, int):
            return -1
        h = self.geo.hash_block_size
        return (request.num_prompt_tokens + max_tokens - 1) // h * h

    def decode_boundary_puts(self, d: SaveDraft, t: Any) -> list[BoundaryPut]:
        """Rule 5: the attention blocks up to each accepted decode boundary of ``d``
        (deduplicated, in boundary order), over the draft's current block table; ``t`` is the
        request's tracker (None: nothing)."""
        if t is None:
            return []
        geo = self.geo
        seen: dict[BoundaryPut, None] = {}
        for b in d.decode_boundaries:
            for p in turn_end_attention_puts(
                    boundary=b, saved_tokens=t.num_saved_tokens,
                    completed_token_len=d.completed_token_len,
                    num_hashes=len(d.block_hashes), block_ids=d.block_ids,
                    block_sizes=geo.block_sizes, is_mamba=geo.is_mamba,
                    eagle_margins=self.eagle_margins, hash_block_size=geo.hash_block_size):
                seen[BoundaryPut(*p)] = None
        return list(seen)
