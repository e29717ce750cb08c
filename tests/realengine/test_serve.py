"""``vllm serve`` (vLLM's OpenAI server, engine core in its own process) with
``TailproofConnector`` on the memory store, over HTTP on 127.0.0.1: completions of token-id
prompts equal the session's ground truth (``conftest.truth``: an engine with prefix caching
off, so its chunk boundaries differ), before and after ``/reset_prefix_cache`` (then served
from the store), also when the reset preempts a running request; ``/metrics`` carries the
connector's series and ``tailproof stats`` reads them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from serving import Server, kv_transfer_config

from tailproof.conformance.realengine.oracle import MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

SUBSET = (0, 4, 7, 11)  # shared-prefix prompts of 16+ to 515+ tokens (conftest.prompts)
LONG = 10  # the prompt the reset-while-running test decodes (400+ tokens, 80 decoded)


@dataclass
class Served:
    srv: Server
    prompts: list[list[int]]
    truth: list[list[int]]

    def case(self) -> tuple[list[list[int]], list[list[int]]]:
        return [self.prompts[i] for i in SUBSET], [self.truth[i] for i in SUBSET]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]],
           request: pytest.FixtureRequest) -> Iterator[Served]:
    """The server and the session's ground truth: the server starts first, the truth engine
    (prefix caching off) runs while it loads unless the session already computed it."""
    from tailproof.conformance.realengine.model import write_model_dir

    model_dir = write_model_dir(tmp_path_factory.mktemp("model"), seed=0)
    kt = kv_transfer_config({"store": "memory", "namespace": "rt-serve"})
    srv = Server(model_dir, kt, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        truth = [list(t) for t in request.getfixturevalue("truth")]
        srv.wait_ready()
        yield Served(srv, prompts, truth)
    finally:
        srv.stop()


def _metric(text: str, name: str) -> float:
    """Sum of every sample of ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completions_equal_the_ground_truth_cold_and_from_the_store(
        served: Served) -> None:
    srv = served.srv
    prompts, want = served.case()
    assert srv.complete(prompts, MAX_TOKENS) == want  # cold
    srv.post("/reset_prefix_cache")  # urlopen raises unless 2xx
    before = _gets(srv)
    assert srv.complete(prompts, MAX_TOKENS) == want  # store hits
    assert _gets(srv) > before


def _gets(srv: Server) -> int:
    """Keys the connector has read from the store (``tailproof stats``' reading of /metrics)."""
    from tailproof.conformance.tools.stats import parse, summary

    return int(summary(parse(srv.get_text("/metrics")))["gets"]["keys"])


def test_metrics_and_tailproof_stats(served: Served) -> None:
    srv = served.srv
    text = srv.get_text("/metrics")
    assert "vllm:tailproof_" in text
    res = subprocess.run([sys.executable, "-m", "tailproof.conformance.cli.main", "stats", srv.url,
                          "--json", "--timeout", "30"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["lookups"] > 0 and stats["lookup_hits"] > 0
    assert stats["gets"]["keys"] > 0 and stats["puts"]["keys"] > 0


def test_reset_with_a_running_request_over_http(served: Served) -> None:
    """``/reset_prefix_cache?reset_running_requests=true`` while a completion decodes after a
    store hit: it finishes, with the ground truth's tokens."""
    srv, long = served.srv, served.prompts[LONG]
    assert srv.complete([long], 1)  # stored
    srv.post("/reset_prefix_cache")
    readmitted0 = _event(srv, "readmitted_after_preemption")
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(srv.complete([long], MAX_TOKENS)))
    t.start()
    # Until the request decodes: its generated tokens show in /metrics.
    gen0 = _metric(srv.get_text("/metrics"), "vllm:generation_tokens_total")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a poll of the server's state, not a fixed wait
        m = srv.get_text("/metrics")
        if (_metric(m, "vllm:num_requests_running") >= 1
                and _metric(m, "vllm:generation_tokens_total") >= gen0 + 4):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the completion never decoded")
    srv.post("/reset_prefix_cache?reset_running_requests=true")
    t.join(300)
    assert not t.is_alive(), "the completion never returned"
    assert out == [[served.truth[LONG]]]
    assert _event(srv, "readmitted_after_preemption") == readmitted0 + 1  # with its load


def _event(srv: Server, name: str) -> int:
    """A ``vllm:tailproof_events_total`` count, summed over the engine's series."""
    from tailproof.conformance.tools.stats import parse

    return int(parse(srv.get_text("/metrics"))["events"].get(name, 0))
