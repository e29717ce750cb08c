"""Connector telemetry: counters, vLLM stats aggregation, Prometheus series."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tailproof.impl.metrics import (
    SchedulerMetrics,
    TailproofPromMetrics,
    TailproofStats,
    WorkerMetrics,
)
from tailproof.impl.stores import Outcome


def test_lookup_hits_split_by_granularity() -> None:
    m = SchedulerMetrics()
    m.record_lookup(45, 44, 16)
    m.record_lookup(70, 64, 16)
    m.record_lookup(10, 0, 16)
    d = m.drain()
    assert d["lookups"] == 3 and d["lookup_hits"] == 2 and d["lookup_hits_sub_block_tail"] == 1
    assert d["hit_tokens_whole_blocks"] == 32 + 64 and d["hit_tokens_sub_block_tail"] == 12
    assert m.drain() == {"pinned_blocks": 0}  # drained per interval (gauges persist)


def test_a_drain_takes_every_count_once() -> None:
    """The scheduler's drain skips the named counters' lock when none was counted, and never
    loses one counted after a drain."""
    m = SchedulerMetrics()
    m.jobs_emitted, m.pinned_blocks = 2, 129
    assert not m.c.pending()
    assert m.drain() == {"pinned_blocks": 129, "jobs_emitted": 2}
    m.c.inc("lookups_deferred")
    assert m.c.pending()
    assert m.drain() == {"pinned_blocks": 129, "lookups_deferred": 1}
    assert not m.c.pending() and m.drain() == {"pinned_blocks": 129}
    assert m.c.total("lookups_deferred") == 1


def test_failures_counted_by_kind_and_stats_aggregate() -> None:
    w1, w2 = WorkerMetrics(), WorkerMetrics()
    w1.record_batch("put", [Outcome.success(8), Outcome.full(-200), Outcome.exists()], 8)
    w2.record_batch("get", [Outcome.miss(), Outcome.timeout()], 0)
    w1.c.set("pressure_active", 1)
    w1.c.sample("job_latency_s", 0.002)
    w2.c.sample("job_latency_s", 0.004)
    s = TailproofStats(data=w1.drain()).aggregate(TailproofStats(data=w2.drain()))
    r = s.reduce()
    assert r["put_fail_store_full"] == 1 and r["put_exists"] == 1 and r["put_bytes"] == 8
    assert r["get_fail_miss"] == 1 and r["get_fail_timeout"] == 1
    assert r["pressure_active"] == 1 and r["job_latency_s_count"] == 2
    assert r["job_latency_s_avg_ms"] == 3.0
    assert not s.is_empty() and TailproofStats().is_empty()


def test_prometheus_series() -> None:
    reg = CollectorRegistry()
    types = {Counter: partial(Counter, registry=reg), Gauge: partial(Gauge, registry=reg),
             Histogram: partial(Histogram, registry=reg)}
    prom = TailproofPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                                ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"puts": 0, "put_keys": 3, "pinned_blocks": 5, "job_latency_s": [0.01]}, 0)
    assert reg.get_sample_value("vllm:tailproof_events_total",
                                {"model_name": "m", "engine": "0", "event": "put_keys"}) == 3
    assert reg.get_sample_value("vllm:tailproof_state",
                                {"model_name": "m", "engine": "0", "state": "pinned_blocks"}) == 5
    assert reg.get_sample_value("vllm:tailproof_job_latency_seconds_count",
                                {"model_name": "m", "engine": "0"}) == 1
