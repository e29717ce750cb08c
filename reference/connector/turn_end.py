"""EXTENSION, not vLLM 0.33: turn-end checkpoints and decode-time block boundaries.

The rules of ``docs/reuse.md`` (rules 1-7), off unless ``config.connector`` turns them on
(``turn_end_checkpoints``, ``decode_boundary_saves``, ``checkpoint_lookup_wait``).
``scheduler.py`` and ``lookup.py`` call in here at the points below (marked ``EXTENSION``
there) and are otherwise vLLM 0.33's Mooncake scheduler:

- per step, after the step's jobs are built and pinned: :meth:`TurnEnd.take_snapshots` (rule 1,
  the copies themselves are the worker's, rule 2) and, for the step's hand-offs,
  :func:`decode_boundary_puts` (rule 5);
- at preemption: :meth:`TurnEnd.release` (rule 4);
- at finish, after the finish-time partial tail: :meth:`TurnEnd.flush` (rule 3), or already
  in the step whose snapshot is the request's last boundary before a finish by length
  (rule 3b);
- with ``checkpoint_lookup_wait`` (rule 7): every pinned job's Mamba keys are remembered in
  :class:`InflightKeys` until its pins are released, and a lookup extending one of them past
  its hit waits (``get_num_new_matched_tokens`` answers None).

Snapshot blocks ("slots") are ordinary KV blocks taken from the core's block pool, one per
Mamba group per request, held with one reference until the request ends or is preempted; a
flush job pins them like any other job, so they outlive the connector's reference until every
worker reported (I14). ``tailproof.impl.scheduler_side`` restates these rules independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.meta import BoundaryPut, RequestTracker, StoreJob
from tailproof.spec.arithmetic import (
    NULL_BLOCK_ID,
    running_state_index,
    snapshot_due,
    turn_end_attention_puts,
)


class SlotPool(Protocol):
    """What the extension needs of the block pool (``BlockPool.get_new_blocks`` /
    ``get_num_free_blocks`` / ``free_blocks``), by block id."""

    def take_ids(self, n: int) -> list[int]: ...

    def num_free(self) -> int: ...

    def free_ids(self, ids: list[int]) -> None: ...


@dataclass(frozen=True)
class Snapshot:
    """One copy a step's workers make after the forward: Mamba group ``group``'s running state
    block ``src`` -> the request's slot ``slot``, which then holds the state at ``boundary``."""

    req_id: str
    group: int
    src: int
    slot: int
    boundary: int


def attention_puts(geo: StoreGeometry, boundary: int, saved: int, completed: int,
                    num_hashes: int, block_ids: Sequence[list[int]]) -> list[BoundaryPut]:
    """``turn_end_attention_puts`` over the store geometry: every non-Mamba block from the last
    normal save up to ``boundary``, keyed at its end (shared arithmetic with the spec)."""
    groups = range(len(geo.block_sizes))
    puts = turn_end_attention_puts(
        boundary=boundary, saved_tokens=saved, completed_token_len=completed,
        num_hashes=num_hashes, block_ids=tuple(block_ids), block_sizes=geo.block_sizes,
        is_mamba=tuple(g in geo.mamba_group_ids for g in groups),
        eagle_margins=tuple(geo.eagle_proof_margin_by_group.get(g, 0) for g in groups),
        hash_block_size=geo.hash_block_size)
    return [BoundaryPut(*p) for p in puts]


def decode_boundary_puts(geo: StoreGeometry, boundaries: list[int], tracker: RequestTracker,
                         completed: int, num_hashes: int,
                         block_ids: Sequence[list[int]]) -> list[BoundaryPut]:
    """Rule 5: the attention puts that make each accepted decode-time Mamba boundary a full
    hit, in boundary order, without repeats; the tracker's saved offset does not move."""
    out: list[BoundaryPut] = []
    for b in sorted(set(boundaries)):
        for p in attention_puts(geo, b, tracker.num_saved_tokens, completed, num_hashes,
                                 block_ids):
            if p not in out:
                out.append(p)
    return out


def running_state_blocks(geo: StoreGeometry, mamba: Sequence[int], n: int,
                         table: Sequence[list[int]]) -> list[int] | None:
    """Each Mamba group's running state block after ``n`` tokens, in ``mamba`` order; None
    when one is missing or the null block (rule 6)."""
    out = []
    for g in mamba:
        idx = running_state_index(n, geo.block_sizes[g])
        if not 0 <= idx < len(table[g]) or table[g][idx] == NULL_BLOCK_ID:
            return None
        out.append(table[g][idx])
    return out


class InflightKeys:
    """Rule 7: the Mamba boundary keys of pinned store jobs, ``key hash -> [boundary, jobs]``
    (the first boundary registered under a hash is kept), until the jobs' pins are released."""

    def __init__(self, geo: StoreGeometry) -> None:
        self.geo = geo
        self.keys: dict[bytes, list[int]] = {}
        self.job_keys: dict[int, list[bytes]] = {}

    def register(self, job: StoreJob) -> None:
        """A job that pinned blocks: remember the key of each of its Mamba puts."""
        h = self.geo.hash_block_size
        keys = []
        for p in job.boundary_puts:
            if p.group_id in self.geo.mamba_group_ids and 0 < p.num_tokens // h <= len(
                    job.block_hashes):
                key = bytes(job.block_hashes[p.num_tokens // h - 1])
                self.keys.setdefault(key, [p.num_tokens, 0])[1] += 1
                keys.append(key)
        if keys:
            assert job.store_job_id is not None
            self.job_keys[job.store_job_id] = keys

    def release(self, job_id: int) -> None:
        """The job's pins were released: forget its keys."""
        for key in self.job_keys.pop(job_id, ()):
            entry = self.keys[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.keys[key]

    def awaits(self, num_tokens: int, block_hashes: Sequence[bytes], hit: int) -> bool:
        """Whether a request's prompt extends, past ``hit``, a key an in-flight job puts."""
        h = self.geo.hash_block_size
        return any(hit < b < num_tokens and b // h <= len(block_hashes)
                   and bytes(block_hashes[b // h - 1]) == key
                   for key, (b, _) in self.keys.items())


class TurnEnd:
    """The connector's snapshot blocks: ``slots[rid] = (slot per Mamba group, boundary)``."""

    def __init__(self, conf: ConnectorConfig, geo: StoreGeometry, pool: SlotPool) -> None:
        self.conf = conf
        self.geo = geo
        self.pool = pool
        self.mamba = sorted(geo.mamba_group_ids)  # store order
        self.slots: dict[str, tuple[list[int], int]] = {}

    @property
    def on(self) -> bool:
        """Rules 1-4 apply: turned on, for a producer (never a consumer, rule 6), with Mamba."""
        return self.conf.turn_end_checkpoints and self.conf.is_producer and bool(self.mamba)

    def _sources(self, n: int, table: Sequence[list[int]]) -> list[int] | None:
        return running_state_blocks(self.geo, self.mamba, n, table)

    def _target(self, rid: str, final: bool) -> list[int] | None:
        """The request's slots, else new ones while fewer than ``checkpoint_slots`` requests
        hold some and the pool keeps ``checkpoint_reserve_blocks`` free after taking them. A
        ``final`` snapshot (rule 3b: flushed in its own step, so its blocks are held for one
        step, by the job) needs neither: only free blocks."""
        if rid in self.slots:
            return self.slots[rid][0]
        if not final and len(self.slots) >= self.conf.checkpoint_slots:
            return None
        reserve = 0 if final else self.conf.checkpoint_reserve_blocks
        if self.pool.num_free() - len(self.mamba) < reserve:
            return None
        return self.pool.take_ids(len(self.mamba))

    def take_snapshots(self, steps: list[tuple[str, int, int, Sequence[list[int]] | None, int]]
                       ) -> tuple[list[Snapshot], list[str]]:
        """Rule 1, for the step's scheduled requests in ``CachedRequestData`` order as
        ``(rid, n, num_prompt_tokens, current table, last boundary)`` with ``n`` the computed
        tokens after the step: a snapshot where ``n`` is a hash boundary past ck(P). Also
        returns, in that order, the requests whose snapshot is their last boundary (rule 3b:
        the caller flushes them in this step)."""
        out: list[Snapshot] = []
        final: list[str] = []
        if not self.on:
            return out, final
        h = self.geo.hash_block_size
        for rid, n, prompt, table, last in steps:
            if table is None or not snapshot_due(n, prompt, h, self.geo.use_eagle):
                continue
            src = self._sources(n, table)
            if src is None:
                continue
            slots = self._target(rid, n == last)
            if slots is None:
                continue
            self.slots[rid] = (slots, n)
            out += [Snapshot(rid, g, s, t, n)
                    for g, s, t in zip(self.mamba, src, slots, strict=True)]
            if n == last:
                final.append(rid)
        return out, final

    @staticmethod
    def last_boundary(num_prompt_tokens: int, max_tokens: int | None, h: int) -> int:
        """Rule 3b: the last hash boundary a request finishing by length computes,
        ``floor_h(P + max_tokens - 1)``; -1 when the request does not say."""
        if not isinstance(max_tokens, int):
            return -1
        return (num_prompt_tokens + max_tokens - 1) // h * h

    def release(self, rid: str) -> None:
        """Rules 3-4: drop the connector's reference on the request's slots (preempted, or
        finished without a flush)."""
        held = self.slots.pop(rid, None)
        if held is not None:
            self.pool.free_ids(list(held[0]))

    def flush(self, rid: str, tracker: RequestTracker | None, num_computed: int,
              block_hashes: Sequence[bytes], num_prompt_tokens: int,
              block_ids: tuple[list[int], ...]) -> StoreJob | None:
        """Rule 3: the turn-end job (offload-only: the attention blocks from the last normal
        save up to the snapshot's boundary ``b``, then each slot keyed at ``b``), or None (and
        the slots released) when there is no snapshot, no tracker, or ``b`` is not computed
        and hashed. The caller numbers and pins the job, then calls :meth:`release`."""
        held = self.slots.get(rid)
        if held is None:
            return None
        slots, b = held
        if (tracker is None or b > num_computed
                or b // self.geo.hash_block_size > len(block_hashes)):
            self.release(rid)
            return None
        attention = attention_puts(self.geo, b, tracker.num_saved_tokens, num_computed,
                                    len(block_hashes), block_ids)
        mamba = [BoundaryPut(g, s, b) for g, s in zip(self.mamba, slots, strict=True)]
        return StoreJob(
            req_id=rid, token_len_chunk=0, block_ids=tuple(list(ids) for ids in block_ids),
            block_hashes=list(block_hashes), can_save=True, num_prompt_tokens=num_prompt_tokens,
            prefill_end_tokens=tracker.prefill_end_tokens, boundary_puts=[*attention, *mamba],
            completed_token_len=num_computed)
