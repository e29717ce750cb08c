"""``CoreBackend`` over the pure-Python reference model (``tailproof.reference``).

Mirrors ``vllm_core.VllmCoreBackend`` call for call (the calls that are the same on both are
``core_base.ManagerBackend``), so that the two can differ only in what the
models do: a lookup's hit stays pending for the request until the next ``allocate``; a successful
allocation advances ``num_computed_tokens`` by the hit and the external tokens, as
``Scheduler.schedule`` does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tailproof.conformance.harness.adapters.core_base import ManagerBackend
from tailproof.reference.block_pool import Block
from tailproof.reference.geometry import Geometry
from tailproof.reference.kv_manager import KVCacheManager
from tailproof.reference.managers import MambaAlignManager
from tailproof.reference.request import Request, RequestStatus
from tailproof.reference.scheduler_split import plan_chunk


def _ids(blocks: list[list[Block]]) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks]


class ReferenceCoreBackend(ManagerBackend):
    """The reference model as a ``CoreBackend`` (see module docstring)."""

    status = RequestStatus

    def __init__(self, config: Any) -> None:
        self.config = config
        self.geo = Geometry.from_config(config)
        self.manager = KVCacheManager(self.geo)
        self.block_pool = self.manager.block_pool
        self.requests: dict[str, Request] = {}
        self.pending: dict[str, tuple[list[list[Block]], int]] = {}

    # -- requests -----------------------------------------------------------------------
    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> int:
        req = Request(rid, list(prompt), self.geo.hash_block_size, max_tokens)
        self.requests[rid] = req
        return len(req.block_hashes)

    def set_counters(
        self,
        rid: str,
        *,
        num_computed_tokens: int | None = None,
        num_in_flight_tokens: int | None = None,
    ) -> None:
        r = self.requests[rid]
        if num_computed_tokens is not None:
            r.num_computed_tokens = num_computed_tokens
            r.status = RequestStatus.RUNNING
        if num_in_flight_tokens is not None:
            r.num_in_flight_tokens = num_in_flight_tokens

    # -- lookup, planning, allocation ---------------------------------------------------
    def lookup(self, rid: str, max_len: int | None) -> tuple[int, list[list[int]]]:
        req = self.requests[rid]
        blocks, hit, junction = self.manager.get_computed_blocks(req, max_len)
        if req.num_computed_tokens == 0:
            # Scheduler.schedule assigns the junction at admission (num_computed_tokens == 0).
            req.shared_prefix_boundary = junction
        self.pending[rid] = (blocks, hit)
        return hit, _ids(blocks)

    def plan_chunk(self, rid: str, num_new_tokens: int, hit_tokens: int, external: int) -> int:
        return plan_chunk(self.geo, self.requests[rid], num_new_tokens, hit_tokens, external)

    def junction_hook(self, manager_keys: bool = False) -> bool:
        """EXTENSION (docs/junctions.md, "The hook"): the connector's scheduler hook sets
        ``Scheduler.mamba_shared_prefix_checkpoint``, refused without partial hits (vLLM 0.33's
        ``mamba_partial_cache_hit``); with ``manager_keys`` (``device_junctions``) also the
        managers' junction keying. Returns whether the split now stops at the junction."""
        if not self.geo.mamba_partial_cache_hit:
            return False
        self.geo = replace(self.geo, scheduler_junction_hook=True,
                           manager_junction_hook=manager_keys)
        for m in self.manager.coordinator.managers:
            if isinstance(m, MambaAlignManager):  # KVCacheManager.__init__ sets Mamba's only
                m.shared_prefix_checkpoint = self.geo.manager_shared_prefix_checkpoint
        return True

    def allocate(
        self,
        rid: str,
        num_new_tokens: int,
        *,
        use_hit: bool,
        external: int,
        delay_cache: bool,
        lookahead: int,
        reserved: int = 0,
    ) -> list[list[int]] | None:
        req = self.requests[rid]
        pending = self.pending.pop(rid, None)
        blocks, hit = pending if (use_hit and pending is not None) else (None, 0)
        new = self.manager.allocate_slots(
            req,
            num_new_tokens,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=lookahead,
            num_external_computed_tokens=external,
            delay_cache_blocks=delay_cache,
            reserved_blocks=reserved,
        )
        if new is None:
            return None
        req.num_computed_tokens += hit + external
        req.status = RequestStatus.RUNNING
        return _ids(new)

    def truncate(self, rid: str, num_tokens: int) -> list[list[int]]:
        blocks, _ = self.pending[rid]
        return _ids(self.manager.truncate_computed_blocks(blocks, num_tokens))

    def block_ids_for_computed_tokens(self, rid: str) -> list[list[int]]:
        return self.manager.get_block_ids_for_computed_tokens(
            rid, self.requests[rid].num_computed_tokens)

    # -- copies, hand-offs, finish ------------------------------------------------------
    def drain_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        copies, retained = self.manager.take_kv_cache_block_copies()
        return copies, [b.block_id for b in retained]

    def release(self, block_ids: list[int]) -> None:
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[i] for i in block_ids])

    def finalize_tail(self, rid: str) -> list[tuple[int, int, int]]:
        return self.manager.finalize_partial_tail_offloads(self.requests[rid])

    def remove_skipped(self, rid: str) -> None:
        req = self.requests[rid]
        processed = max(0, req.num_computed_tokens - req.num_in_flight_tokens)
        self.manager.coordinator.remove_skipped_blocks(rid, processed)

    def free(self, rid: str) -> None:
        self.manager.free(self.requests[rid])

    def table(self, rid: str) -> list[list[int]]:
        return self.manager.get_block_ids(rid)

    # -- inspection ---------------------------------------------------------------------
    def free_queue(self) -> list[int]:
        return self.block_pool.free_block_queue.block_ids()

    def keys(self) -> list[tuple[int, int, int]]:
        return sorted(self.block_pool.keys())
