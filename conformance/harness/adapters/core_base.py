"""What both core backends share: the calls that are the same on vLLM 0.33's
``KVCacheManager`` and on the reference's, whose API mirrors it name for name.

A subclass sets ``manager``, ``block_pool``, ``requests``, ``pending`` (the lookup hit kept
for the next ``allocate``) and ``status`` (its ``RequestStatus`` enum) and writes the calls
whose arguments or results differ (``backend.CoreBackend`` documents each).
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.harness.backend import RequestView


class ManagerBackend:
    """The ``CoreBackend`` calls that read or change a ``KVCacheManager`` the same way on
    both implementations."""

    manager: Any
    block_pool: Any
    requests: dict[str, Any]
    pending: dict[str, tuple[Any, int]]
    status: Any  # the RequestStatus enum of the requests

    def append_output(self, rid: str, tokens: list[int]) -> int:
        req = self.requests[rid]
        req.append_output_token_ids(list(tokens))
        return len(req.block_hashes)

    def get(self, rid: str) -> RequestView:
        r = self.requests[rid]
        return RequestView(r.num_tokens, r.num_prompt_tokens, r.num_computed_tokens,
                           r.num_in_flight_tokens, r.shared_prefix_boundary)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def cache_blocks(self, rid: str, num_tokens: int) -> None:
        self.manager.cache_blocks(self.requests[rid], num_tokens)

    def truncate_pending(self, rid: str, num_tokens: int) -> None:
        blocks, _ = self.pending[rid]
        self.pending[rid] = (self.manager.truncate_computed_blocks(blocks, num_tokens), num_tokens)

    def drain_offloads(self) -> list[tuple[str, int, int, int]]:
        out = self.manager.take_boundary_state_offloads()
        return [(rid, g, blk, b) for rid, entries in out.items() for g, blk, b in entries]

    def preempt(self, rid: str) -> None:
        """The block side of ``Scheduler._preempt_request`` (SC:1799-1843)."""
        req = self.requests[rid]
        self.manager.free(req)
        req.status = self.status.PREEMPTED
        req.num_computed_tokens = 0

    def evict(self, block_ids: set[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def reset(self) -> bool:
        return self.manager.reset_prefix_cache()

    def num_free(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def refcounts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.block_pool.blocks[1:] if b.ref_cnt > 0}
