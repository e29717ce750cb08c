"""Store-side shared-prefix junctions: which prompts share a prefix with an earlier one.

vLLM 0.33 detects a junction only in the local device cache, and only where full attention
keyed a block (docs/junctions.md, rule 1): with attention blocks of 1,024 a system prompt that
ends off that grid is never seen as shared. The connector sees every admitted prompt's chained
h-block hashes, so it can tell exactly how far a new prompt agrees with any earlier one: the
hash of block k names the whole prefix ``(k + 1) * h``, so one set probe per block, from the
prompt's end down, finds the longest shared prefix.

:class:`JunctionCheckpoints` (EXTENSION, not vLLM 0.33; ``docs/junctions.md``, "The extension")
is the junction part of the reuse extension, a collaborator of
``tailproof.impl.extension.ReuseExtension``, restated independently of
``tailproof.reference.connector.junctions`` (the corpus compares the two):
:meth:`~JunctionCheckpoints.at_lookup` at the connector lookup (``get_num_new_matched_tokens``),
:meth:`~JunctionCheckpoints.jobs` per step after the turn-end snapshot pass; the pending stop
is dropped at preemption and everything at finish (:meth:`~JunctionCheckpoints.forget`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import Snapshot, TailproofMeta
from tailproof.impl.metrics import SchedulerMetrics
from tailproof.impl.turn_end import TurnEndCheckpoints, snapshot_sources
from tailproof.spec.arithmetic import checkpoint_position

logger = logging.getLogger(__name__)


class JunctionIndex:
    """The chained block hashes of recently admitted prompts, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("junction index capacity must be >= 1")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def known_prefix_blocks(self, block_hashes: Sequence[bytes], limit: int) -> int:
        """How many leading blocks of ``block_hashes`` (at most ``limit``) some earlier prompt
        also had: the largest k with ``block_hashes[k - 1]`` indexed (0: none). Scanned from
        the top: one set probe per block, exact even when eviction left holes in a chain."""
        for k in range(min(limit, len(block_hashes)), 0, -1):
            if block_hashes[k - 1] in self._hashes:
                return k
        return 0

    def add(self, block_hashes: Sequence[bytes], num_blocks: int) -> None:
        """Index the first ``num_blocks`` hashes of a prompt (refreshing their recency)."""
        hashes = self._hashes
        # Reversed: a prompt's first blocks (the part most often shared) stay the most recent.
        for bh in reversed(block_hashes[:num_blocks]):
            if bh in hashes:
                hashes.move_to_end(bh)
            else:
                hashes[bh] = None
        while len(hashes) > self.capacity:
            hashes.popitem(last=False)


def key_device_junctions(kvm: Any) -> bool:
    """Turn on vLLM 0.33's manager-side junction keying without EAGLE (``device_junctions``;
    docs/junctions.md, "Device junctions"): ``KVCacheManager.mamba_shared_prefix_checkpoint``
    and every ``MambaManager.shared_prefix_checkpoint`` together, the two sides
    ``KVCacheManager.__init__`` says must agree; refused under a multi-module MTP re-prefill
    tail (``num_reprefillable_tokens``), as vLLM refuses it. Returns whether it is on."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    coord = getattr(kvm, "coordinator", None)
    if coord is None or getattr(coord, "num_reprefillable_tokens", 0) != 0:
        logger.error("TailproofConnector: device_junctions needs vLLM's KVCacheManager without "
                     "a re-prefill tail; junction states are stored by the connector instead")
        return False
    for manager in coord.single_type_managers:
        if isinstance(manager, MambaManager):
            manager.shared_prefix_checkpoint = True
    kvm.mamba_shared_prefix_checkpoint = True
    return True


class JunctionCheckpoints:
    """The junction part of the reuse extension (a collaborator of
    ``extension.ReuseExtension``; no index for a consumer, which stores nothing)."""

    def __init__(self, settings: Settings, geo: StoreGeometry, metrics: SchedulerMetrics,
                 turn_end: TurnEndCheckpoints) -> None:
        self.settings = settings
        self.geo = geo
        self.metrics = metrics
        # The snapshot sources and the sealed checkpoint jobs are the turn-end part's.
        self.turn_end = turn_end
        self.mamba_groups = turn_end.mamba_groups
        # Admitted prompts' hashes, each request's junction (computed once, at its first
        # admission), and the ones whose stop is pending.
        self.index = JunctionIndex(settings.junction_index_blocks)
        self.seen: dict[str, int] = {}
        self.targets: dict[str, int] = {}
        self.exact_stops = False  # set by TailproofConnector.on_scheduler_built (the hook)
        self._warned_no_hook = False
        self._reasons_logged: set[str] = set()
        # Whether vLLM keys the Mamba state at its own junction (KVCacheManager's
        # ``mamba_shared_prefix_checkpoint``: only with an EAGLE group); set by the hook.
        self.vllm_keys_junctions = True

    def forget(self, rid: str, *, finished: bool) -> None:
        """A finished request is forgotten; a preempted one keeps its junction (computed at
        its first admission) but its pending stop goes (its re-admission sets it again)."""
        if finished:
            self.seen.pop(rid, None)
        self.targets.pop(rid, None)

    def at_lookup(self, request: Any, hit: int) -> None:
        """Junction rule 1 (docs/junctions.md): the longest prefix (h-floored, below the
        prompt's own checkpoint) this prompt shares with an earlier admitted one; when it is
        past every hit and off the Mamba grid, the request's chunk stops there
        (``Request.shared_prefix_boundary``, read by ``Scheduler._mamba_block_aligned_split``
        in this same step; exact through the scheduler hook) and a junction job stores it."""
        rid = request.request_id
        self.targets.pop(rid, None)  # an earlier ask of a request not then scheduled
        geo = self.geo
        h = geo.hash_block_size
        p = request.num_prompt_tokens
        j = self.seen.get(rid)
        if j is None:  # first admission: compare with earlier prompts, then index this one
            j = self.index.known_prefix_blocks(request.block_hashes, (p - 1) // h) * h
            self.index.add(request.block_hashes, p // h)
            self.seen[rid] = j
        ck = checkpoint_position(p, h, geo.use_eagle)
        if j <= 0:
            return  # nothing shared with an earlier prompt
        spb = request.shared_prefix_boundary
        if j <= hit:
            return self.skipped("served", "the store or local cache already serves it")
        if j >= ck:
            return self.skipped("prompt_tail", "it is the prompt's own checkpoint")
        if j < spb:
            return self.skipped("vllm_junction_later",
                                "vLLM's own junction stops the chunk later")
        if j == spb and self.vllm_keys_junctions:
            return self.skipped("vllm_junction", "vLLM marks and stores this junction itself")
        # j == spb without an EAGLE group: vLLM marks this junction itself (its split stops the
        # chunk there, exactly through the hook) but MambaManager keys no state at it, so it
        # is taken like any other (docs/junctions.md, extension rule 2).
        if all(j % geo.block_sizes[g] == 0 for g in self.mamba_groups):
            return self.skipped("aligned", "vLLM hands off an aligned state there")
        if not self.exact_stops:
            if not self._warned_no_hook:
                logger.warning("junction_checkpoints is on but vLLM's scheduler hook did not "
                               "run (docs/junctions.md, 'The hook'): no junction stops")
                self._warned_no_hook = True
            self.metrics.c.inc("junctions_skipped_no_hook")
            return
        if j == spb:
            self.metrics.c.inc("junctions_set_at_vllm_junction")
        request.shared_prefix_boundary = j
        self.metrics.c.inc("junctions_set")
        if self.vllm_keys_junctions and all(j % geo.block_sizes[g] == 0 for g in
                                            range(len(geo.is_mamba)) if not geo.is_mamba[g]):
            # device_junctions: MambaManager keys the state where the chunk stops (it reads
            # Request.shared_prefix_boundary) and hands it off like a prompt tail; on every
            # attention grid the normal saves cover the attention KV, so the connector copies
            # nothing (docs/junctions.md, "Device junctions"). Off that grid the hand-off
            # stores no attention KV up to j: the junction job below still does.
            self.metrics.c.inc("junctions_set_device_keyed")
            return
        self.targets[rid] = j

    def skipped(self, reason: str, why: str) -> None:
        """Count a junction the extension resolved on but did not act on, and say why once
        per reason (``junctions_skipped_<reason>``; docs/junctions.md)."""
        self.metrics.c.inc(f"junctions_skipped_{reason}")
        if reason not in self._reasons_logged:
            self._reasons_logged.add(reason)
            logger.info("TailproofConnector: a junction was not stored: %s "
                        "(counted as junctions_skipped_%s; logged once)", why, reason)

    def jobs(self, ends: Mapping[str, int], state: Any, meta: TailproofMeta,
             requests: Mapping[str, Any]) -> None:
        """Junction rule 2: a step whose chunk ended at the request's junction copies the running
        state into fresh blocks (``meta.snapshots``, applied after the forward) and a store job
        of this same step puts them under the junction's key with the attention KV from the lcm
        floor; the job's pins are the blocks' only holders (the connector's reference is
        dropped at once)."""
        geo = self.geo
        pool = self.turn_end.pool
        for rid, n in ends.items():
            target = self.targets.get(rid)
            if target is None or n < target:
                continue  # no stop pending, or the chunk ended before it (a later one stops)
            del self.targets[rid]
            if n > target:  # the chunk ran past it: vLLM moved the request's junction
                self.skipped("stop_missed", "the chunk did not stop at it (vLLM re-assigned "
                             "Request.shared_prefix_boundary)")
                continue
            req = requests[rid][0]
            table = state.get_block_ids(rid)
            srcs = snapshot_sources(geo, self.mamba_groups, table, n)
            k = len(self.mamba_groups)
            if srcs is None:
                self.skipped("no_source", "the request's running Mamba state block is missing "
                             "or the null block")
                continue
            if pool.get_num_free_blocks() - k < self.settings.checkpoint_reserve_blocks:
                self.skipped("reserve", "taking a block would leave fewer than "
                             "checkpoint_reserve_blocks free")
                continue
            slots = [b.block_id for b in pool.get_new_blocks(k)]
            meta.snapshots += [Snapshot(rid, g, src, slot, n) for g, src, slot in
                               zip(self.mamba_groups, srcs, slots, strict=True)]
            ids = tuple([list(table[g]) for g in geo.core_group_ids])
            lcm = geo.scheduler_block_size
            job = self.turn_end.checkpoint_job(req, slots, n, ids, n // lcm * lcm, n,
                                               "junction_jobs")
            blocks = pool.blocks
            pool.free_blocks([blocks[b] for b in slots])
            meta.stores.append(job)
