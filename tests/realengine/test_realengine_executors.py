"""The ``mp`` executor (worker in its own process, engine core in its own process): the bed's
passes and worker helpers work there too (vLLM's device prefix cache; the memory store needs
the worker in the scheduler's process, so the connector is Mooncake's business there)."""

from __future__ import annotations

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]


def test_mp_executor_warm_pass_equals_ground_truth(prompts: list, truth: list) -> None:
    with tb.Bed(tb.EngineSpec(executor="mp", core_process=True)) as bed:
        cold = bed.generate(prompts, oracle.MAX_TOKENS)
        warm = bed.generate(prompts, oracle.MAX_TOKENS)
        views = bed.worker(tb.registered_kv_caches)
    for name, got in (("cold", cold), ("warm", warm)):
        res = oracle.compare(truth, got, name)
        assert res.ok, "\n".join(res.differences)
    assert all(c.num_cached_tokens for c in warm)
    assert len(views) == 1 and len(views[0]) == 4
