"""Per-request connector state and the store jobs handed to workers (mirrors ``data.py``).

``ReqMeta`` (MD:752-865), ``RequestTracker`` (MD:701-741), ``LoadSpec`` (MD:690-698),
``BoundaryPut`` (MD:744-749) and ``TailKeyBoundary`` (MD:655-671) keep vLLM's names and
fields. Block hashes are carried as the request's own list (the reference core's chained
digests), so a key is ``(group, digest)`` as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tailproof.spec.arithmetic import cdiv, round_down


class BoundaryPut(NamedTuple):
    """A block stored under the hash of the prefix ending at ``num_tokens`` (MD:744-749)."""

    group_id: int
    block_id: int
    num_tokens: int


class TailKeyBoundary(NamedTuple):
    """The boundary whose prefix hash keys group ``group_id``'s last stored block (MD:655-671)."""

    group_id: int
    num_tokens: int


@dataclass
class LoadSpec:
    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    can_load: bool
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


@dataclass
class RequestTracker:
    req_id: str
    token_len: int
    allocated_block_ids: tuple[list[int], ...]
    num_saved_tokens: int = 0
    has_pending_offload: bool = False
    prefill_end_tokens: int = 0
    partial_tail_sent: bool = False
    # DEVIATION (readable pins, scheduler.py): (job id, offset) every rank reported reaching
    # after that job of this generation; ``generation`` counts resets (the request's
    # preemption generation, the spec's ``Req.generation``: a job of an earlier generation
    # never confirms anything).
    confirmed: tuple[int, int] = (-1, 0)
    generation: int = 0

    def reset(self) -> None:
        """``RequestTracker.reset`` on preemption (MD:717-724): everything zeroed."""
        self.token_len = 0
        self.allocated_block_ids = ()
        self.num_saved_tokens = 0
        self.has_pending_offload = False
        self.prefill_end_tokens = 0
        self.partial_tail_sent = False
        self.confirmed = (-1, 0)
        self.generation += 1

    def update(self, new_block_ids: tuple[list[int], ...]) -> None:
        """Append-only mirror of new block ids (MD:726-741)."""
        if len(new_block_ids) != len(self.allocated_block_ids):
            raise ValueError("Group count mismatch")
        for existing, new in zip(self.allocated_block_ids, new_block_ids, strict=True):
            existing.extend(new)


@dataclass
class StoreJob:
    """One request's entry in a step's connector metadata (vLLM 0.33's ``ReqMeta`` (MD:752-865)):
    a store job when ``can_save`` (it gets an id when pinned), else a load (``load_spec``)."""

    req_id: str
    token_len_chunk: int
    block_ids: tuple[list[int], ...]
    block_hashes: Sequence[bytes]
    can_save: bool = False
    load_spec: LoadSpec | None = None
    token_ids_start: int = 0
    num_prompt_tokens: int | None = None
    prefill_end_tokens: int | None = None
    store_job_id: int | None = None
    boundary_puts: list[BoundaryPut] = field(default_factory=list)
    completed_token_len: int | None = None
    publish_partial_tail: bool = False
    pin_floor: int = 0  # DEVIATION (readable pins): a rank below it reads no normal save


def from_request_tracker(
    tracker: RequestTracker,
    lcm: int,
    block_hashes: Sequence[bytes],
    *,
    load_spec: LoadSpec | None = None,
    skip_save: bool | None = False,
    save_partial_tail: bool = False,
    num_prompt_tokens: int | None = None,
) -> StoreJob | None:
    """mirrors ``ReqMeta.from_request_tracker`` (MD:788-865): save the lcm floor of the tracked
    length once it passes the next lcm boundary, or when the prompt's partial tail is first due;
    a meta never carries both a save and a load (the load wins)."""
    token_len = tracker.token_len
    start = tracker.num_saved_tokens
    chunk_boundary = cdiv(start + 1, lcm) * lcm
    to_save = round_down(token_len, lcm)
    publish = (save_partial_tail and not tracker.partial_tail_sent
               and num_prompt_tokens is not None and 0 < num_prompt_tokens <= token_len)
    skip = bool(skip_save) or (to_save < chunk_boundary and not publish)
    if load_spec is not None and load_spec.can_load:
        skip = True
    if skip and load_spec is None:
        return None
    if not skip:
        tracker.num_saved_tokens = to_save
        tracker.partial_tail_sent |= publish
    if not (load_spec is not None and load_spec.can_load):
        load_spec = None
    return StoreJob(
        req_id=tracker.req_id, token_len_chunk=to_save, block_ids=tracker.allocated_block_ids,
        block_hashes=block_hashes, can_save=not skip, load_spec=load_spec,
        token_ids_start=start, num_prompt_tokens=num_prompt_tokens,
        prefill_end_tokens=tracker.prefill_end_tokens, completed_token_len=token_len,
        publish_partial_tail=publish and not skip,
    )
