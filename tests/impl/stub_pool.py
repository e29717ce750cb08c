"""A stand-in GPU block pool for the scheduler-side tests: 64 blocks, touches and frees by id."""

from __future__ import annotations

from types import SimpleNamespace


class Pool:
    """Counts each block's references; a free below zero is a double release."""

    def __init__(self) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(64)]

    def touch(self, blocks: list) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:  # noqa: ANN001
        for b in blocks:
            assert b.ref_cnt > 0, "double release"
            b.ref_cnt -= 1
