"""What the scheduler role sends the workers each step, and what the workers send back.

Why separate: both roles (and the conformance adapter) build and read these; keeping them plain
dataclasses of ints/bytes makes them picklable across vLLM's process boundary and trivially
comparable in tests. Group indices are *store* group indices (see ``config.Geometry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class BoundaryPut(NamedTuple):
    """Put block ``block_id`` of store group ``group`` under the hash of ``[0, num_tokens)``."""

    group: int
    block_id: int
    num_tokens: int


@dataclass
class LoadJob:
    """Load ``[local_tokens, hit_tokens)`` of a request into its freshly allocated blocks.

    ``tail_keys[g]`` is the boundary whose hash keys group g's last loaded block (the hit itself,
    or a later boundary inside the same block, e.g. an EAGLE proof key).
    """

    req_id: str
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    local_tokens: int
    hit_tokens: int
    tail_keys: tuple[int, ...]
    is_async: bool = True  # False: a sync load feeding this step's forward


@dataclass(slots=True)
class StoreJob:
    """One store job: an optional normal save up to ``token_len`` plus boundary puts.

    The scheduler holds one GPU block reference on every block the job may read (``pins``) until
    every worker reported the job done, so the job can never read a reused block. ``job_id`` is
    None while the scheduler is still building the job (before it is pinned).
    """

    job_id: int | None
    req_id: str
    token_len: int  # normal-save end, floored to the lcm (0: boundary puts only)
    block_ids: tuple[list[int], ...]
    block_hashes: list[bytes]
    boundary_puts: list[BoundaryPut] = field(default_factory=list)
    start: int = 0  # tokens saved before this job (observation only)
    publish: bool = False  # the save that first covers the prompt (publishes its tail)
    completed: int = 0  # tokens computed when the job was built (bounds the EAGLE proof)
    num_prompt_tokens: int = 0  # fixes the checkpoint ck(P) whose tail is published


@dataclass
class TailproofMeta(KVConnectorMetadata):
    """One step's work for every worker."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)


@dataclass
class TailproofWorkerMeta(KVConnectorWorkerMetadata):
    """Per step, per worker: store jobs finished (job id -> number of workers done)."""

    completed_jobs: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TailproofWorkerMeta:
        assert isinstance(other, TailproofWorkerMeta)
        for job, n in other.completed_jobs.items():
            self.completed_jobs[job] = self.completed_jobs.get(job, 0) + n
        return self


def store_key(namespace: str, rank: int, world: int, group: int, block_hash: bytes) -> str:
    """The store key of one block: namespace, rank shard, store group, prefix hash.

    Keys are content addresses: the hash covers the whole token prefix (vLLM's chained block
    hash), so two equal keys always mean equal KV and puts can be write-once.
    """
    return f"{namespace}@r{rank}of{world}@g{group}@{block_hash.hex()}"
