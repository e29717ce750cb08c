"""Connector telemetry: counters per role, vLLM ``KVConnectorStats`` and Prometheus metrics.

Semantics: none in the reference (observability only; no behaviour depends on it). Mirrors vLLM
0.33's ``MooncakeStoreConnectorStats`` / ``MooncakeStorePromMetrics``.

Why: an offload tier that silently stops hitting (store full, master down, sub-block tails never
published) looks exactly like a healthy one from the outside. The counters split hits by
granularity (whole lcm blocks vs sub-block tails, the part this project exists for), count every
put/get outcome by kind, and expose the pressure gate and the number of pinned GPU blocks.

Flow: each role accumulates into a plain dict; ``get_kv_connector_stats`` hands vLLM a
:class:`TailproofStats` (picklable, summed across workers by ``aggregate``), and
:class:`TailproofPromMetrics` turns the same dict into ``vllm:tailproof_*`` series.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: Gauges: the latest value wins when aggregating (they are states, not events).
GAUGES = ("pressure_active", "pinned_blocks", "queued_jobs")
#: Latency samples (seconds), kept as lists so percentiles can be computed.
SAMPLES = ("job_latency_s", "load_latency_s")  # enqueue -> done, per job


class Counters:
    """A thread-safe bag of named counters, gauges and latency samples, drained per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._totals: dict[str, int] = {}  # since start, never drained (tests, debugging)

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0) + n
            self._totals[name] = self._totals.get(name, 0) + n

    def total(self, name: str) -> int:
        """Count of ``name`` since start (unaffected by :meth:`drain`)."""
        with self._lock:
            return self._totals.get(name, 0)

    def totals(self) -> dict[str, int]:
        """Every count since start (unaffected by :meth:`drain`; tests, ``tailproof smoke``)."""
        with self._lock:
            return dict(self._totals)

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._data[name] = value

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self._data.setdefault(name, []).append(value)

    def get(self, name: str) -> Any:
        with self._lock:
            return self._data.get(name, 0)

    def pending(self) -> bool:
        """Whether anything was counted, set or sampled since the last drain (a lock-free
        read: a count racing it is drained next time, never lost)."""
        return bool(self._data)

    def drain(self) -> dict[str, Any]:
        """Return the interval's data and start a new interval (gauges persist)."""
        with self._lock:
            out = self._data
            self._data = {k: v for k, v in out.items() if k in GAUGES}
            return out


class SchedulerMetrics:
    """Scheduler-role counters (lookups, hit granularity, store jobs, pins)."""

    def __init__(self) -> None:
        self.c = Counters()
        self.jobs_emitted = 0
        self.loads_emitted = 0
        self.offloads_dropped = 0
        self.lookup_errors = 0
        self.pinned_blocks = 0  # gauge, published at drain time (kept off the step path)
        self.lookup_counts = [0] * 6  # see LOOKUP_NAMES

    def record_lookup(self, num_tokens: int, hit: int, lcm: int) -> None:
        """One lookup; the hit split into whole lcm blocks and the sub-block tail beyond."""
        whole = hit // lcm * lcm
        lk = self.lookup_counts
        lk[0] += 1
        lk[1] += num_tokens
        lk[2] += whole
        lk[3] += hit - whole
        lk[4] += hit > 0
        lk[5] += hit > whole

    #: names of ``lookup_counts`` entries, in order
    LOOKUP_NAMES = ("lookups", "lookup_tokens", "hit_tokens_whole_blocks",
                    "hit_tokens_sub_block_tail", "lookup_hits", "lookup_hits_sub_block_tail")

    def total(self, name: str) -> int:
        """Lookup counter ``name`` since the last drain (tests)."""
        return self.lookup_counts[self.LOOKUP_NAMES.index(name)]

    def drain(self) -> dict[str, Any]:
        """The interval's counters (plain ints on the scheduler's single thread, no lock; the
        named counters' lock only when one was counted: a drain runs every step)."""
        data = self.c.drain() if self.c.pending() else {}
        data["pinned_blocks"] = self.pinned_blocks
        lk = self.lookup_counts
        if lk[0]:  # no lookup: every lookup count is 0
            for name, v in zip(self.LOOKUP_NAMES, lk, strict=True):
                if v:
                    data[name] = v
            self.lookup_counts = [0] * len(self.LOOKUP_NAMES)
        for name in ("jobs_emitted", "loads_emitted", "offloads_dropped", "lookup_errors"):
            if v := getattr(self, name):
                data[name] = v
                setattr(self, name, 0)
        return data


class WorkerMetrics:
    """Worker-role counters (puts, gets, bytes, failures by kind, pressure, job latency)."""

    def __init__(self) -> None:
        self.c = Counters()

    def record_batch(self, op: str, outcomes: list[Any], nbytes: int) -> None:
        """Count one put/get batch: keys, bytes moved, and every non-success by its status."""
        self.c.inc(f"{op}_batches")
        self.c.inc(f"{op}_keys", len(outcomes))
        self.c.inc(f"{op}_bytes", nbytes)
        for o in outcomes:
            ok = o.saved if op == "put" else o.ok
            if o.status.value == "exists":
                self.c.inc("put_exists")
            if not ok:
                self.c.inc(f"{op}_fail_{o.status.value}")

    def drain(self) -> dict[str, Any]:
        return self.c.drain()


@dataclass
class TailproofStats(KVConnectorStats):
    """vLLM connector stats: ``data`` is the drained counter dict of one or more roles."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if k in GAUGES:
                self.data[k] = max(self.data.get(k, 0), v)
            elif isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, list):
                if v:
                    s = sorted(v)
                    out[f"{k}_count"] = len(s)
                    out[f"{k}_avg_ms"] = round(sum(s) / len(s) * 1e3, 3)
                    out[f"{k}_p99_ms"] = round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3, 3)
            else:
                out[k] = v
        return out


class TailproofPromMetrics(KVConnectorPromMetrics):
    """``vllm:tailproof_*`` Prometheus series, one per counter (failures labelled by kind)."""

    def __init__(
        self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._events = self._counter_cls(
            name="vllm:tailproof_events_total",
            documentation="Tailproof connector events (lookups, puts, gets, bytes, failures).",
            labelnames=labelnames + ["event"],
        )
        self._gauge = self._gauge_cls(
            name="vllm:tailproof_state",
            documentation=("Tailproof connector state: pressure_active (0/1), pinned_blocks, "
                           "queued_jobs."),
            labelnames=labelnames + ["state"],
            multiprocess_mode="mostrecent",
        )
        self._latency = self._histogram_cls(
            name="vllm:tailproof_job_latency_seconds",
            documentation="Latency of one store job or load on a worker.",
            buckets=[1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0],
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, v in (transfer_stats_data or {}).items():
            if k in GAUGES:
                self._gauge.labels(*labels, k).set(v)
            elif isinstance(v, list):
                hist = self._latency.labels(*labels)
                for x in v:
                    hist.observe(x)
            elif v:
                self._events.labels(*labels, k).inc(v)
