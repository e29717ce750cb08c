"""The impl adapter releases everything a trace allocated when the trace ends: replaying the
corpus over and over in one process keeps the thread count and resident memory flat (issue
20, item 8: its finalizer once held the adapter through its own arguments, so every trace left
its KV tensors and two threads per rank behind)."""

from __future__ import annotations

import copy
import gc
import os
import threading

import pytest

pytest.importorskip("vllm")

from tailproof.conformance.format.trace import load_trace, parse_trace  # noqa: E402
from tailproof.conformance.harness.adapters import make_driver, refusal  # noqa: E402
from tailproof.conformance.harness.corpus import corpus_paths  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402

pytestmark = pytest.mark.vllm

OPTIONS = {"impl": {"store": "memory", "device": "cpu"}}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _connector_traces() -> list:
    """Every other corpus case the impl adapter runs with its connector (half the corpus's
    connector cases: each kind of connector op, at a tenth of the full run's time)."""
    traces = [load_trace(p) for p in corpus_paths()]
    runs = [t for t in traces if t.config.connector is not None
            and refusal("impl", t.config) is None]
    return runs[::2]


def _round(traces: list) -> None:
    for t in traces:
        res = run_trace(t, ["impl"], options=OPTIONS)
        assert not res.divergences, (t.name, res.divergences[0])
    gc.collect()


def test_corpus_ten_times_flat_threads_and_memory() -> None:
    traces = _connector_traces()
    assert len(traces) >= 20
    _round(traces)  # warm-up: imports, allocator arenas, vLLM's caches
    # Measured after the warm-up: threads earlier tests of this process left behind may end
    # while the rounds run (never counted as growth); a leak adds threads every round.
    threads0 = threading.active_count()
    rss1 = _rss_mib()
    threads, rss = [], []
    for _ in range(9):
        _round(traces)
        threads.append(threading.active_count())
        rss.append(_rss_mib())
    assert max(threads) <= threads0, (threads0, threads)  # before the fix: +2 per rank per trace
    assert max(rss) - rss1 < 32, (rss1, rss)  # before the fix: +8 MiB a round here


def test_big_pool_trace_ten_times_keeps_one_pool() -> None:
    """A trace with a large KV pool: ten replays hold at most one pool's tensors at a time."""
    base = min((p for p in corpus_paths() if p.name.startswith("conn_")),
               key=lambda p: p.stat().st_size)
    doc = copy.deepcopy(load_trace(base).raw)
    bs = max(g["block_size"] for g in doc["config"]["groups"])
    doc["config"]["num_blocks"] = (1 << 19) // bs  # an eighth of the pool-size limit
    for op in doc["ops"]:
        op.pop("expect", None)  # free counts change with the pool
    trace = parse_trace(doc, str(base))
    _round([trace])
    rss1 = _rss_mib()
    for _ in range(9):
        _round([trace])
    pool_mib = rss1 / 4  # generous: one pool is well under a quarter of the process here
    assert _rss_mib() - rss1 < pool_mib, (rss1, _rss_mib())


def test_unclosed_driver_is_released_by_the_collector() -> None:
    """A caller that never closes the driver (the lockstep runner, tests): dropping it stops
    the workers' threads (the finalizer's arguments no longer reach the adapter)."""
    trace = _connector_traces()[0]
    before = threading.active_count()
    driver = make_driver("impl", trace.config, OPTIONS["impl"])
    for op in trace.ops:
        driver.apply(op)
    assert threading.active_count() > before  # the ranks' sender/receiver threads run
    del driver
    gc.collect()
    assert threading.active_count() == before
