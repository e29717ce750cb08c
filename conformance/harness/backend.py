"""The narrow interface the trace driver needs from an implementation of vLLM's core.

Both the reference model and vLLM 0.33's real ``KVCacheManager`` are wrapped in a
``CoreBackend``; the driver (``conformance/harness/driver.py``) turns trace ops into calls on it and
builds every observation the same way, so adapters cannot disagree on formatting.
All block references are plain ints (block ids; 0 is the null block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class RequestView:
    """What the driver reads and writes of a request (mirrors ``vllm.v1.request.Request``)."""

    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_in_flight_tokens: int
    shared_prefix_boundary: int = 0  # the junction the admission lookup set (0: none)


class KVObserver(Protocol):
    """What a backend reports as it goes, for an adapter that keeps real KV bytes in step
    with the block tables (the ``impl`` adapter): forwards and CoW copies."""

    def computed(self, rid: str, start: int, end: int) -> None:
        """Tokens ``[start, end)`` of ``rid`` were just computed (its forward ran)."""

    def copies(self, pairs: list[tuple[int, int]]) -> None:
        """CoW copies ``(src, dst)`` just queued by the core, in queue order."""


class CoreBackend(Protocol):
    """Scheduler-side block lifecycle of one engine (one ``KVCacheManager``)."""

    requests: dict[str, Any]  # the engine's own request objects by id (what a connector reads)

    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> int:
        """Create a request hashed at h; return its number of block hashes."""

    def append_output(self, rid: str, tokens: list[int]) -> int:
        """``Request.append_output_token_ids``; return the number of block hashes."""

    def get(self, rid: str) -> RequestView:
        """Current counters of a request."""

    def set_counters(
        self, rid: str, *, num_computed_tokens: int | None = None,
        num_in_flight_tokens: int | None = None,
    ) -> None:
        """Play the model runner / scheduler bookkeeping (``_update_after_schedule``)."""

    def new_step(self) -> None:
        """``KVCacheManager.new_step_starts``."""

    def lookup(self, rid: str, max_len: int | None) -> tuple[int, list[list[int]]]:
        """``get_computed_blocks``: (hit tokens, block ids per group). Keeps the hit pending
        for the request (replacing any earlier one) for a later ``allocate(use_hit=True)``
        or ``truncate``; changes no block state."""

    def plan_chunk(self, rid: str, num_new_tokens: int, hit_tokens: int, external: int) -> int:
        """``Scheduler._mamba_block_aligned_split`` for this request."""

    def allocate(
        self, rid: str, num_new_tokens: int, *, use_hit: bool, external: int,
        delay_cache: bool, lookahead: int, reserved: int = 0,
    ) -> list[list[int]] | None:
        """``allocate_slots`` with the pending hit (if ``use_hit``) and external tokens
        (``reserved``: ``reserved_blocks``, free blocks the allocation must leave); on
        success returns the new block ids per group and, as the scheduler does, sets
        ``num_computed_tokens += hit + external``. The pending hit is consumed either way."""

    def drain_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """``take_kv_cache_block_copies``: ([(src, dst)], retained ids in release order)."""

    def release(self, block_ids: list[int]) -> None:
        """``block_pool.free_blocks`` of a drained retained list (in the given order)."""

    def drain_offloads(self) -> list[tuple[str, int, int, int]]:
        """``take_boundary_state_offloads`` flattened: [(rid, group, block, boundary)]."""

    def finalize_tail(self, rid: str) -> list[tuple[int, int, int]]:
        """``finalize_partial_tail_offloads``: [(group, block, boundary)]."""

    def cache_blocks(self, rid: str, num_tokens: int) -> None:
        """``KVCacheManager.cache_blocks``: the delayed cache of an asynchronous load that
        landed (``Scheduler._update_waiting_for_remote_kv``)."""

    def remove_skipped(self, rid: str) -> None:
        """``KVCacheManager.remove_skipped_blocks`` on the processed-token basis (computed
        minus in flight), as ``Scheduler._connector_finished`` calls it before a finish-time
        hand-off."""

    def free(self, rid: str) -> None:
        """``KVCacheManager.free`` (request finished or aborted)."""

    def preempt(self, rid: str) -> None:
        """``Scheduler._preempt_request``: free blocks, ``num_computed_tokens = 0``, status
        PREEMPTED."""

    def evict(self, block_ids: set[int]) -> None:
        """``KVCacheManager.evict_blocks``."""

    def reset(self) -> bool:
        """``KVCacheManager.reset_prefix_cache``."""

    def truncate(self, rid: str, num_tokens: int) -> list[list[int]]:
        """``truncate_computed_blocks`` of the pending hit (may raise AssertionError)."""

    def truncate_pending(self, rid: str, num_tokens: int) -> None:
        """Replace the pending hit by its first ``num_tokens`` tokens, as ``Scheduler.schedule``
        does before allocating when a remote hit replaces a local sub-block tail
        (``KVCacheManager.truncate_computed_blocks``, KM:809-840)."""

    def block_ids_for_computed_tokens(self, rid: str) -> list[list[int]]:
        """``KVCacheManager.get_block_ids_for_computed_tokens`` (KM:740-758): the table with
        attention groups clipped to the computed tokens (what ``_connector_finished`` hands the
        connector)."""

    def table(self, rid: str) -> list[list[int]]:
        """``get_block_ids``: the request's block table per group."""

    def num_free(self) -> int:
        """``block_pool.get_num_free_blocks``."""

    def refcounts(self) -> dict[int, int]:
        """ref_cnt of every non-null block with ref_cnt > 0."""

    def free_queue(self) -> list[int]:
        """Free-queue order, front (next allocated) first."""

    def keys(self) -> list[tuple[int, int, int]]:
        """Every prefix-cache key as (group, boundary_tokens, block id), primary and secondary."""
