"""What the scheduler role sends the workers each step, and what the workers send back.

Semantics: ``tailproof.reference.connector.meta`` (its ``ReqMeta`` / ``RequestTracker`` /
``LoadSpec``). Mirrors vLLM 0.33's ``mooncake/store/data.py``
(``ReqMeta``, ``LoadSpec``, ``BoundaryPut``, ``TailKeyBoundary``, ``MooncakeStoreWorkerMetadata``),
whose field names these records keep. Unlike vLLM, one step's metadata carries loads and store
jobs as two record types (:class:`LoadJob`, :class:`StoreJob`) instead of one ``ReqMeta`` with
``load_spec`` / ``can_save``; a store job is a mutable :class:`SaveDraft` until the scheduler
seals it. Plain dataclasses of ints and bytes: picklable across vLLM's
process boundary. Group indices are *store* group indices (see ``config.StoreGeometry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class BoundaryPut(NamedTuple):
    """Put block ``block_id`` of store group ``group_id`` under the hash of
    ``[0, num_tokens)`` (``data.BoundaryPut``)."""

    group_id: int
    block_id: int
    num_tokens: int


class TailKeyBoundary(NamedTuple):
    """The boundary whose prefix hash keys group ``group_id``'s last loaded block
    (``data.TailKeyBoundary``): the hit itself, or a later boundary inside the same block
    (an EAGLE proof key)."""

    group_id: int
    num_tokens: int


class Snapshot(NamedTuple):
    """Copy the Mamba state of store group ``group`` from the request's running state block
    ``src_block`` into its snapshot block ``slot_block``, after this step's forward: the slot
    then holds the state of the prefix ``boundary`` (docs/reuse.md, rules 1-2)."""

    req_id: str
    group: int
    src_block: int
    slot_block: int
    boundary: int


@dataclass(kw_only=True)
class LoadJob:
    """Load ``[vllm_cached_tokens, kvpool_cached_tokens)`` of a request into its freshly
    allocated blocks (a ``ReqMeta`` whose ``load_spec.can_load`` is set)."""

    req_id: str
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...]
    is_async: bool = True  # False: a sync load feeding this step's forward
    epoch: str = "0"  # the scheduler's key epoch when it built the load (``keys.KeySpace``)


@dataclass(slots=True, kw_only=True)
class SaveDraft:
    """A store job while ``SchedulerSide.build_connector_meta`` assembles it (scheduler role
    only; never sent to a worker). The step's passes fill it in -- the save decision
    (``_maybe_save``), the core's Mamba hand-offs (``_handle_boundary_state_offloads``), the
    current tables of window groups -- and ``SchedulerSide.seal`` turns it into the one
    :class:`StoreJob` the workers get, or drops it (pin budget)."""

    req_id: str
    token_len_chunk: int  # normal-save end, floored to the lcm (0: boundary puts only)
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    boundary_puts: list[BoundaryPut] = field(default_factory=list)
    token_ids_start: int = 0  # tokens the scheduler had saved before this job
    publish_partial_tail: bool = False  # the save that first covers the prompt
    completed_token_len: int = 0  # tokens computed when the job was built (bounds EAGLE proof)
    num_prompt_tokens: int = 0  # fixes the checkpoint ck(P) whose tail is published
    prefill_end_tokens: int = 0  # replay boundary of the store mask (sparse retention only)
    # Decode-time aligned Mamba boundaries accepted this step (``decode_boundary_saves``): the
    # seal also puts the attention blocks up to each (``turn_end_attention_puts``).
    decode_boundaries: list[int] = field(default_factory=list)


class StoreJob(NamedTuple):
    """One sealed store job (a ``ReqMeta`` with ``can_save``): boundary puts, then an optional
    normal save. Built only by ``SchedulerSide.seal``, which also took its id and its pins.
    Immutable (a named tuple: as cheap to build as a mutable record, on the scheduler's hot
    path, where a frozen dataclass costs three times as much).

    The normal save covers, on each rank, the non-Mamba blocks from that rank's own saved
    offset up to ``token_len_chunk`` (vLLM's ``KVCacheStoreSendingThread``: a rank resumes
    where its last successful save ended, which lags after a failed or skipped put), never
    from ``token_ids_start`` (what the scheduler had saved, an observation only) and never
    below ``pin_floor`` (``readable_pins``: a rank below it reads nothing for the normal save).

    The scheduler holds one GPU block reference on every block the job may read until every
    worker reported the job done, so the job can never read a reused block. ``block_ids`` and
    ``block_hashes`` may be the request's live, append-only lists (the tracker's mirror, the
    request's hashes): later steps append to them, never change what the job reads.
    """

    store_job_id: int
    req_id: str
    token_len_chunk: int  # normal-save end, floored to the lcm (0: boundary puts only)
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    boundary_puts: tuple[BoundaryPut, ...] = ()
    token_ids_start: int = 0  # tokens the scheduler had saved before this job (observation)
    publish_partial_tail: bool = False  # the save that first covers the prompt
    completed_token_len: int = 0  # tokens computed when the job was built (bounds EAGLE proof)
    num_prompt_tokens: int = 0  # fixes the checkpoint ck(P) whose tail is published
    prefill_end_tokens: int = 0  # replay boundary of the store mask (sparse retention only)
    epoch: str = "0"  # the scheduler's key epoch when it sealed the job (``keys.KeySpace``)
    # ``readable_pins``: the token offset from which the job's normal-save blocks are pinned
    # (0: the whole table, vLLM 0.33's rule).
    pin_floor: int = 0


@dataclass
class TailproofMeta(KVConnectorMetadata):
    """One step's work for every worker (``MooncakeStoreConnectorMetadata``)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Snapshot copies the workers make after this step's forward, before its store jobs.
    snapshots: list[Snapshot] = field(default_factory=list)


@dataclass
class TailproofWorkerMeta(KVConnectorWorkerMetadata):
    """Per step, per worker: ``store_job_id`` -> number of workers done with it
    (``MooncakeStoreWorkerMetadata``), and -> the lowest saved offset of the job's request on
    the reporting workers once the job was over (not vLLM 0.33: it bounds what a later job of
    the request can read, ``SchedulerSide`` with ``readable_pins``)."""

    completed_saves: dict[int, int] = field(default_factory=dict)
    saved_offsets: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TailproofWorkerMeta:
        assert isinstance(other, TailproofWorkerMeta)
        for job, n in other.completed_saves.items():
            self.completed_saves[job] = self.completed_saves.get(job, 0) + n
        for job, off in other.saved_offsets.items():
            mine = self.saved_offsets.get(job)
            self.saved_offsets[job] = off if mine is None else min(mine, off)
        return self

