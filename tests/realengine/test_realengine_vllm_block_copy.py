"""vLLM 0.33 itself: a device partial prefix-cache hit is wrong when a Mamba layer precedes the
attention layer it shares a KV cache tensor with.

``copy_kv_cache_blocks_inplace`` (``v1/worker/utils.py``) copies a CoW'd block once per shared
allocation, through the first layer's view (it skips views with a data pointer it has seen).
vLLM pairs the i-th layer of each KV cache group into one tensor and pads Mamba pages to the
attention page; a Mamba view covers only the state bytes of its page, so when it comes first the
attention K/V beyond them is not copied and the request attends over stale slots. The test bed
puts attention first (``model.py``); this test keeps the finding honest: it fails (and the bed's
ordering can be relaxed) once vLLM copies every view.
"""

from __future__ import annotations

import random

import pytest

from tailproof.conformance.realengine import bed as tb

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.parametrize("mamba_first", [True, False], ids=["mamba-first", "attention-first"])
def test_device_partial_hit_depends_on_layer_order(mamba_first: bool) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 64) for _ in range(288)] + [5] * 20  # 308: a hit at 304
    with tb.Bed(tb.EngineSpec(mamba_first=mamba_first)) as bed:
        (cold,) = bed.generate([prompt], 16)  # computed from scratch: nothing cached yet
        (warm,) = bed.generate([prompt], 16)  # device partial hit inside the 5th block
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 304
    if mamba_first:
        assert warm.tokens != cold.tokens, "vLLM now copies the attention K/V of a CoW'd block"
    else:
        assert warm.tokens == cold.tokens
