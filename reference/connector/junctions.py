"""EXTENSION, not vLLM 0.33: junction checkpoints (``docs/junctions.md``, "The extension").

Off unless ``config.connector.junction_checkpoints`` turns them on. ``scheduler.py`` calls in
here at the points marked ``EXTENSION`` there:

- at the connector lookup (``get_num_new_matched_tokens``, when it answered): :meth:`Junctions.
  at_lookup` computes the request's junction once (its first ask: the longest prefix, in whole
  hash blocks below ck(P), an earlier admitted prompt shares), indexes the prompt, and sets
  ``Request.shared_prefix_boundary`` to it when it lies past the hit, below ck(P), past vLLM's
  own junction (or at it, when the core keys no Mamba state there: no EAGLE group), off some
  Mamba block grid, and the scheduler hook is active; the chunk split of the same step then
  stops there (``Scheduler._mamba_block_aligned_split`` with ``mamba_shared_prefix_checkpoint``);
- per step, after the turn-end snapshot pass: :meth:`Junctions.jobs` turns every request whose
  step ends at its junction into snapshot copies into fresh pool blocks (only while
  ``checkpoint_reserve_blocks`` stay free) and a same-step store job (the attention KV from the
  lcm floor to J, then the copies under J's Mamba key); the caller pins it, registers its keys
  (rule 7) and drops the connector's reference on the fresh blocks at once;
- at preemption the pending stop is forgotten (re-admission asks again); at finish, all of it.

``tailproof.impl.junctions`` (``JunctionCheckpoints.at_lookup``, ``.jobs``) restates these
rules independently: the corpus compares the two.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.meta import BoundaryPut, StoreJob
from tailproof.reference.connector.turn_end import (
    SlotPool,
    Snapshot,
    attention_puts,
    running_state_blocks,
)
from tailproof.spec.arithmetic import checkpoint_position


class JunctionRequest(Protocol):
    """The request fields the junction rules read and the one they write."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[bytes]
    shared_prefix_boundary: int


class PromptIndex:
    """Least-recently-used set of admitted prompts' block hashes, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def longest(self, hashes: Sequence[bytes], limit: int) -> int:
        """The largest ``k <= limit`` whose block ``k - 1`` is indexed (the hash of a block
        names the whole prefix it ends), scanning down from ``limit``; 0 when none is."""
        k = min(limit, len(hashes))
        while k > 0 and bytes(hashes[k - 1]) not in self.lru:
            k -= 1
        return k

    def add(self, hashes: Sequence[bytes], n: int) -> None:
        """Index a prompt's first ``n`` blocks, last block first, so that its first blocks
        (the part most often shared) are the most recent; then evict the oldest."""
        for i in range(n - 1, -1, -1):
            key = bytes(hashes[i])
            self.lru.pop(key, None)
            self.lru[key] = None
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


class Junctions:
    """The prompt index, each request's junction (computed once) and its pending stop."""

    def __init__(self, conf: ConnectorConfig, geo: StoreGeometry, pool: SlotPool) -> None:
        self.conf = conf
        self.geo = geo
        self.pool = pool
        self.mamba = sorted(geo.mamba_group_ids)  # store order
        self.index = PromptIndex(conf.junction_index_blocks)
        self.seen: dict[str, int] = {}  # rid -> its junction, fixed at its first ask
        self.targets: dict[str, int] = {}  # rid -> the junction its next chunk stops at
        self.hook = False  # the scheduler hook made the split's junction stop exact
        # Whether the core keys the Mamba state at vLLM's own junction (``KVCacheManager.
        # mamba_shared_prefix_checkpoint``: the flag with an EAGLE group); set by the adapter.
        self.vllm_keys = True

    @property
    def on(self) -> bool:
        """Junction lookups apply: turned on, for a producer (a consumer stores nothing)."""
        return self.conf.junction_checkpoints and self.conf.is_producer

    def at_lookup(self, request: JunctionRequest, hit: int) -> None:
        """The connector answered a lookup with ``hit`` tokens (local or store, the larger):
        compute the junction at the first ask and set the stop when it is worth one."""
        if not self.on:
            return
        rid = request.request_id
        self.targets.pop(rid, None)  # an earlier ask that was not scheduled
        h = self.geo.hash_block_size
        p = request.num_prompt_tokens
        if rid not in self.seen:
            self.seen[rid] = self.index.longest(request.block_hashes, (p - 1) // h) * h
            self.index.add(request.block_hashes, min(p // h, len(request.block_hashes)))
        j = self.seen[rid]
        if not hit < j < checkpoint_position(p, h, self.geo.use_eagle):
            return  # served by the hit, or at/after the prompt's own checkpoint
        spb = request.shared_prefix_boundary
        if j < spb or (j == spb and self.vllm_keys):
            return  # vLLM's own junction (the local lookup's) is farther, or keyed by the core
        # j == spb unkeyed (no EAGLE group): vLLM's split stops there but nothing keys the
        # state, so it is taken like a junction of the connector's own.
        if all(j % self.geo.block_sizes[g] == 0 for g in self.mamba):
            return  # on every Mamba grid: an aligned state, handed off and stored already
        if not self.hook:
            return  # the stop would be block-floored: never a stop it cannot use
        request.shared_prefix_boundary = j
        if self.vllm_keys and all(j % b == 0 for g, b in enumerate(self.geo.block_sizes)
                                  if g not in self.mamba):
            # device junctions: the core's MambaManager keys the stop and hands it off, and
            # on every attention grid the normal saves hold the attention KV: no job
            return
        self.targets[rid] = j

    def forget(self, rid: str, finished: bool) -> None:
        """Preemption drops the pending stop (re-admission asks again); a finish, all."""
        self.targets.pop(rid, None)
        if finished:
            self.seen.pop(rid, None)

    def jobs(self, steps: list[tuple[JunctionRequest, int]],
             current_table: Callable[[str], Sequence[list[int]] | None],
             ) -> list[tuple[list[Snapshot], StoreJob, list[int]]]:
        """For each ``(request, n)`` of the step (``n``: its computed tokens after the step,
        in step order) whose ``n`` is its junction: the copies into fresh blocks, the store job
        and the fresh block ids; the stop is spent either way. None taken (the job skipped)
        when a source is missing or the pool would keep fewer than the reserve."""
        out: list[tuple[list[Snapshot], StoreJob, list[int]]] = []
        for req, n in steps:
            rid = req.request_id
            target = self.targets.get(rid)
            if target is None or n < target:
                continue  # nothing pending, or a later chunk reaches it
            del self.targets[rid]
            if n > target:
                continue  # the chunk ran past it (vLLM re-assigned the junction): spent
            table = current_table(rid)
            src = (running_state_blocks(self.geo, self.mamba, n, table) if table is not None
                   else None)
            k = len(self.mamba)
            if src is None or self.pool.num_free() - k < self.conf.checkpoint_reserve_blocks:
                continue
            assert table is not None
            fresh = self.pool.take_ids(k)
            copies = [Snapshot(rid, g, s, t, n) for g, s, t in zip(self.mamba, src, fresh,
                                                                      strict=True)]
            ids = tuple(list(t) for t in table)
            lcm = self.geo.scheduler_block_size
            attention = attention_puts(self.geo, n, n // lcm * lcm, n, len(req.block_hashes),
                                        ids)
            mamba = [BoundaryPut(g, t, n) for g, t in zip(self.mamba, fresh, strict=True)]
            job = StoreJob(req_id=rid, token_len_chunk=0, block_ids=ids,
                          block_hashes=list(req.block_hashes), can_save=True,
                          num_prompt_tokens=req.num_prompt_tokens,
                          boundary_puts=[*attention, *mamba], completed_token_len=n)
            out.append((copies, job, fresh))
        return out
