"""Reference model vs vLLM 0.33 ``KVCacheManager`` on the same allocate/free-heavy workload
(pytest-benchmark, one group so the two rows sit side by side)."""

from __future__ import annotations

import pytest

from benchmarks.core_workload import prepared, prompts, run

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

REQS = prompts(200)


def _backend(name: str):  # noqa: ANN202
    from tailproof.conformance.harness.adapters import ADAPTERS, _load

    return _load(ADAPTERS[name].core)


@pytest.mark.parametrize("name", ["reference", "vllm"])
def test_core_cycle_throughput(benchmark, name: str) -> None:
    cls = _backend(name)
    benchmark.group = "core: 200 requests, 200-token prompts sharing 120 tokens"
    benchmark.pedantic(run, setup=lambda: (prepared(cls, REQS), {}), rounds=7,
                       warmup_rounds=1)
