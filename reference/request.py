"""The scheduler-visible part of a request (mirrors ``vllm.v1.request.Request``)."""

from __future__ import annotations

from enum import Enum

from tailproof.reference.hashing import BlockHash, extend_block_hashes


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"


class Request:
    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "max_tokens",
        "block_hashes",
        "hash_block_size",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "shared_prefix_boundary",
        "status",
    )

    def __init__(
        self, request_id: str, prompt: list[int], hash_block_size: int, max_tokens: int = 16
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.hash_block_size = hash_block_size
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        # Request.shared_prefix_boundary: the junction of a shared prefix whose Mamba state is
        # not cached yet (0: none); set by the admission lookup (Scheduler.schedule).
        self.shared_prefix_boundary = 0
        self.status = RequestStatus.WAITING
        extend_block_hashes(self.block_hashes, self.all_token_ids, hash_block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, tokens: int | list[int]) -> None:
        """``Request.append_output_token_ids`` followed by ``update_block_hashes``."""
        if isinstance(tokens, int):
            self.all_token_ids.append(tokens)
        else:
            self.all_token_ids.extend(tokens)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.hash_block_size)
