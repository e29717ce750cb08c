"""The recorder's writer thread: ops come out in submission order with rotation at step
boundaries, and a write that fails is raised by ``close`` without stopping the submitter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailproof.conformance.capture.writer import (
    STEP_BOUNDARY,
    BackgroundWriter,
    TraceWriter,
    join_segments,
)

HEADER = {"format": "tailproof-trace/1", "name": "w", "config": {}}


def _op(i: int) -> dict[str, int | str]:
    return {"op": "new_step", "i": i}


def test_order_and_rotation(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    bw = BackgroundWriter(TraceWriter(path, HEADER, max_bytes=200), max_pending=2)
    for step in range(20):
        bw.submit([STEP_BOUNDARY, (_op, 2 * step), (lambda i: b'{"op":"x","i":%d}' % i,
                                                     2 * step + 1)])
    bw.close()
    paths = bw.writer.paths
    assert len(paths) > 1  # rotated
    doc = join_segments(paths)
    assert [op["i"] for op in doc["ops"]] == list(range(40))
    assert bw.num_ops == 40
    assert json.loads(paths[1].read_text())["provenance"]["continues"] == paths[0].name


def test_failed_write_is_raised_at_close(tmp_path: Path) -> None:
    bw = BackgroundWriter(TraceWriter(tmp_path / "t.json", HEADER))

    def broken() -> dict[str, str]:
        raise OSError(28, "No space left on device")

    bw.submit([(broken,)])
    for i in range(5):  # the engine keeps running; later batches are dropped
        bw.submit([(_op, i)])
    with pytest.raises(OSError, match="No space"):
        bw.close()
