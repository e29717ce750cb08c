"""``cache_blocks`` outside a landed load: vLLM 0.34's synchronous hybrid engines call it from
``update_from_output`` for every running request after every step; the recorder proves each
such call a no-op (no key inserted or popped, no request entry of a manager changed) and does
not count it, so a sync capture
replays faithfully and says so. A call that does write is still counted as unmodelled."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

from tailproof.conformance.capture.recorder import Recorder  # noqa: E402
from tailproof.conformance.format.trace import load_trace  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402
from tailproof.conformance.tools.capture_engine.engine import CaptureEngine  # noqa: E402
from tailproof.conformance.tools.capture_engine.workloads import WORKLOADS  # noqa: E402

pytestmark = pytest.mark.vllm


def _count_calls(mgr: Any) -> list[int]:
    """Count the manager's ``cache_blocks`` calls from outside (around the recorder's own
    wrapper, which stays in place)."""
    seen = [0]
    inner = mgr.cache_blocks

    def call(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return inner(*args, **kwargs)
    mgr.cache_blocks = call
    return seen


def test_sync_hybrid_capture_counts_no_cache_blocks_and_replays(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    engine = CaptureEngine(async_scheduling=False)
    assert engine.vllm_config.scheduler_config.async_scheduling is False
    rec = Recorder.attach(engine.sched, out)
    calls = _count_calls(engine.sched.kv_cache_manager)
    try:
        WORKLOADS["chat"].run(engine, random.Random(0))
    finally:
        rec.close()
        engine.shutdown()
    # Scheduler.update_from_output's synchronous hybrid branch ran on 0.34 (0.33 has none,
    # and nothing else calls it in this workload).
    assert (calls[0] > 0) == vllm.__version__.startswith("0.34."), calls
    assert "cache_blocks" not in rec.unmodelled, rec.unmodelled
    result = run_trace(load_trace(out), ["reference", "vllm"], strict=True)
    assert result.divergences == []


def test_a_cache_blocks_call_that_writes_is_counted(tmp_path: Path) -> None:
    """Blocks allocated with ``delay_cache_blocks`` (as for an asynchronous load) are cached
    by a later ``cache_blocks`` outside a landed load: that call writes keys, so it is counted;
    repeating it writes nothing and is not."""
    engine = CaptureEngine()
    rec = Recorder.attach(engine.sched, tmp_path / "w.json")
    try:
        req = engine.add("r", list(range(3, 40)))
        mgr = engine.sched.kv_cache_manager
        mgr.new_step_starts()
        assert mgr.allocate_slots(req, 32, delay_cache_blocks=True) is not None
        mgr.cache_blocks(req, 32)
        assert rec.unmodelled.get("cache_blocks") == 1
        mgr.cache_blocks(req, 32)  # everything up to 32 is cached: nothing written
        assert rec.unmodelled.get("cache_blocks") == 1
        # the recorder restored the key map: no instance attribute left behind
        keys = mgr.block_pool.cached_block_hash_to_block
        assert not {"insert", "pop"} & set(vars(keys))
    finally:
        rec.close()
        engine.shutdown()
