"""vLLM itself: a device partial prefix-cache hit is wrong on vLLM 0.33 when a Mamba layer
precedes the attention layer it shares a KV cache tensor with, and right on 0.34.

``copy_kv_cache_blocks_inplace`` (``v1/worker/utils.py``) copies a CoW'd block once per view of
a shared allocation. vLLM pairs the i-th layer of each KV cache group into one tensor and pads
Mamba pages to the attention page; a Mamba view covers only the state bytes of its page. 0.33
skips every view whose data pointer it has seen, so when the Mamba view comes first the
attention K/V beyond it is not copied and the request attends over stale slots. 0.34 keys the
views by geometry too and copies both. Which one the bed's vLLM does is asked of vLLM's own
function (``release.block_copy_covers_every_view``); the engine must agree with it. The test
bed's model puts attention first (``model.py``), which is right on both.
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
        copies_every_view = bed.call(tb.release_switch, "block_copy_covers_every_view")
        (cold,) = bed.generate([prompt], 16)  # computed from scratch: nothing cached yet
        (warm,) = bed.generate([prompt], 16)  # device partial hit inside the 5th block
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 304
    if mamba_first and not copies_every_view:  # vLLM 0.33
        assert warm.tokens != cold.tokens, "vLLM copies the attention K/V of a CoW'd block " \
            "though its copy skips a view at an address it has seen"
    else:
        assert warm.tokens == cold.tokens
