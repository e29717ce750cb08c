"""``tailproof stats URL`` against a local HTTP server that serves the Prometheus text the
connector's real metrics code produces (``TailproofPromMetrics`` fed by the scheduler's and
a worker's counters)."""

from __future__ import annotations

import json
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from tailproof.conformance.cli.main import main

prometheus_client = pytest.importorskip("prometheus_client",
                                        reason="prometheus_client (a vLLM dependency) missing")
pytest.importorskip("vllm", reason="the connector's metrics subclass vLLM 0.33's classes")


def _metrics_text() -> bytes:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from tailproof.impl.metrics import SchedulerMetrics, TailproofPromMetrics, TailproofStats

    reg = CollectorRegistry()
    types = {Counter: partial(Counter, registry=reg), Gauge: partial(Gauge, registry=reg),
             Histogram: partial(Histogram, registry=reg)}
    prom = TailproofPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                                ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    sched = SchedulerMetrics()
    sched.record_lookup(100, 40, 16)  # 32 whole-block tokens + an 8-token sub-block tail
    sched.record_lookup(50, 0, 16)
    sched.pinned_blocks = 7
    data = sched.drain()
    worker = {"put_batches": 2, "put_keys": 6, "put_bytes": 4096, "put_exists": 1,
              "put_fail_full": 2, "get_batches": 1, "get_keys": 3, "get_bytes": 2048,
              "get_fail_timeout": 1, "job_latency_s": [0.002, 0.004]}
    stats = TailproofStats(data=dict(data)).aggregate(TailproofStats(data=worker))
    prom.observe(stats.data, 0)
    prom.observe({"lookups": 1, "lookup_tokens": 10, "put_fail_full": 1}, 1)  # second engine
    return generate_latest(reg)


class _Server:
    def __init__(self, body: bytes, status: int = 200) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body if self.path == "/metrics" else b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_stats_reads_the_connector_series(capsys: pytest.CaptureFixture[str]) -> None:
    with _Server(_metrics_text()) as base:
        assert main(["stats", base, "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert main(["stats", base.removeprefix("http://")]) == 0
        text = capsys.readouterr().out
    assert s["lookups"] == 3 and s["lookup_tokens"] == 160
    assert s["hit_tokens"] == {"whole_blocks": 32, "sub_block_tail": 8, "total": 40}
    assert s["hit_ratio"] == 0.25
    assert s["lookup_hits"] == 1 and s["lookup_hits_sub_block_tail"] == 1
    assert s["puts"] == {"batches": 2, "keys": 6, "bytes": 4096, "exists": 1}
    assert s["gets"] == {"batches": 1, "keys": 3, "bytes": 2048}
    assert s["failures"] == {"get_fail_timeout": 1, "put_fail_full": 3}
    assert s["pinned_blocks"] == 7
    assert s["jobs"]["latency_count"] == 2 and s["jobs"]["latency_avg_ms"] == 3.0
    assert "32 whole blocks + 8 sub-block tail" in text and "hit ratio      25.0%" in text
    assert "pinned blocks  7" in text


def test_stats_without_tailproof_series_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with _Server(b"# no connector here\nvllm:num_requests_running 0.0\n") as base:
        assert main(["stats", base + "/metrics"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no vllm:tailproof_* series" in err[0]
