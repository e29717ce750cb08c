"""A pool small enough to preempt, with the engine core in its own process (vLLM's
``EngineCoreProc`` busy loop): outputs still equal the engine without prefix caching."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

PAGE_BYTES = 2 * 16384  # one block: one page in each of the two shared KV cache tensors
POOL_BLOCKS = 48


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Bed]:
    spec = tb.EngineSpec(kv_transfer_config=tb.memory_connector("preempt"), core_process=True,
                         kv_cache_memory_bytes=POOL_BLOCKS * PAGE_BYTES, max_model_len=1024,
                         max_num_batched_tokens=256)
    with tb.Bed(spec) as b:
        yield b


def test_preempting_pool_passes_equal_ground_truth(bed: tb.Bed, prompts: list,
                                                   truth: list) -> None:
    passes = oracle.run_passes(bed, prompts, oracle.MAX_TOKENS)
    bad = {name: oracle.compare(truth, got, name) for name, got in passes.items()}
    assert all(r.ok for r in bad.values()), {n: r.differences for n, r in bad.items() if not r.ok}
    metrics = bed.call(tb.engine_metrics)
    assert metrics.get("vllm:num_preemptions", 0) > 0, "the pool never preempted"
    assert any(passes["store-hit"][i].num_cached_tokens for i in range(len(prompts)))
