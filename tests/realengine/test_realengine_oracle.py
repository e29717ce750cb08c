"""vLLM's real engine (0.33 or 0.34) with TailproofConnector on the memory store: every pass's
greedy output equals the engine without prefix caching, and the oracle has teeth."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

MAX_TOKENS = oracle.MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

BLOCK = 64
LAYERS = [("model.layers.0.self_attn.attn", 0), ("model.layers.1.mixer", 0),
          ("model.layers.1.mixer", 1), ("model.layers.2.self_attn.attn", 0),
          ("model.layers.3.mixer", 0), ("model.layers.3.mixer", 1)]


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Bed]:
    # A small token budget: prefills take several steps, so requests of one batch hit blocks
    # (and sub-block tails) that others computed in earlier steps.
    spec = tb.EngineSpec(kv_transfer_config=tb.memory_connector("oracle"),
                         block_size=BLOCK, max_num_batched_tokens=256)
    with tb.Bed(spec) as b:
        yield b


@pytest.fixture(scope="module")
def passes(bed: tb.Bed, prompts: list[list[int]]) -> dict[str, list[tb.Completion]]:
    return oracle.run_passes(bed, prompts, MAX_TOKENS)


@pytest.mark.parametrize("name", oracle.PASSES)
def test_pass_equals_ground_truth(name: str, passes: dict, truth: list) -> None:
    res = oracle.compare(truth, passes[name], name)
    assert res.ok, f"{name} differs from the engine without prefix caching:\n" + "\n".join(
        res.differences)


def test_passes_hit_where_they_should(passes: dict, prompts: list[list[int]]) -> None:
    """The passes exercise what they are named for (else equality would prove little)."""
    cached = {name: [c.num_cached_tokens for c in passes[name]] for name in oracle.PASSES}
    assert any(cached["cold"]), "no request hit another's blocks in the cold batch"
    assert all(n > 0 for n in cached["warm"]), cached["warm"]
    # device cache reset: every hit comes from the store, some inside a Mamba block
    assert all(n > 0 for n in cached["store-hit"]), cached["store-hit"]
    assert any(n % BLOCK for n in cached["store-hit"]), cached["store-hit"]
    # a fresh key epoch: nothing stored is reachable, only the batch's own sharing hits again
    assert cached["after-reset"] == cached["cold"]
    assert all(len(p) // BLOCK < (len(p) + MAX_TOKENS - 1) // BLOCK for p in prompts)


def test_store_loads_verified(bed: tb.Bed, passes: dict) -> None:
    (counts,) = bed.worker(tb.connector_counters)
    assert counts.get("get_keys", 0) > 0 and counts.get("put_keys", 0) > 0, counts
    assert not {k: v for k, v in counts.items() if k.startswith(("verify_fail", "load_fail"))}


@pytest.mark.parametrize("layer,part", LAYERS, ids=[f"{n}[{p}]" for n, p in LAYERS])
def test_device_cache_perturbation_changes_outputs(bed: tb.Bed, passes: dict, prompts: list,
                                                   truth: list, layer: str, part: int) -> None:
    """Sensitivity: a one-bit error per block (the sign of its largest value) in one layer's
    cached K/V or Mamba state, while prefix-cache entries point at it, changes the greedy
    tokens of a warm pass."""
    assert oracle.compare(truth, bed.generate(prompts, MAX_TOKENS)).ok  # device cache filled
    assert bed.worker(tb.perturb_device_cache, layer, part)[0] > 0
    res = oracle.compare(truth, bed.generate(prompts, MAX_TOKENS), "perturbed")
    bed.reset_prefix_cache(reset_connector=True)  # drop the perturbed entries everywhere
    assert not res.ok, f"perturbing {layer}[{part}] changed no output"


def test_corrupted_store_values_fail_closed(bed: tb.Bed, passes: dict, prompts: list,
                                            truth: list) -> None:
    """A stored value with a flipped byte fails verification: recomputed, outputs unchanged."""
    bed.reset_prefix_cache(reset_connector=True)
    assert oracle.compare(truth, bed.generate(prompts, MAX_TOKENS)).ok  # store filled
    (before,) = bed.worker(tb.connector_counters)
    (n,) = bed.worker(tb.corrupt_store_values)
    assert n > 0
    bed.reset_prefix_cache()
    res = oracle.compare(truth, bed.generate(prompts, MAX_TOKENS), "corrupted store")
    (after,) = bed.worker(tb.connector_counters)
    failed = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("verify_fail"))
    assert failed > 0, after
    assert res.ok, "\n".join(res.differences)


def test_registered_tensors_are_vllm_views(bed: tb.Bed) -> None:
    """What the runner (0.33: V1; 0.34: the standalone V2) hands ``register_kv_caches`` in the real
    engine (docs/impl.md): attention as typed fused-K/V 4D views, Mamba as int8 page views of the
    state bytes, one attention and one Mamba layer per shared tensor, pages padded to the attention
    page."""
    (views,) = bed.worker(tb.registered_kv_caches)
    page = 2 * BLOCK * 2 * 16 * 4  # kv heads x block x (K+V head size) x float32
    state = (3 * 64 + 64 * 16) * 4  # conv (K-1, di) + SSM (di, n), float32
    for i in (0, 2):
        attn = views[f"model.layers.{i}.self_attn.attn"]
        mamba = views[f"model.layers.{i + 1}.mixer"]
        assert attn["dtype"] == "torch.float32" and attn["shape"][1:] == [2, BLOCK, 32]
        assert attn["stride"][0] * 4 == page  # LBNHC: [B, H, N, C] with N outside H
        assert attn["stride"][1:] == [32, 64, 1]
        assert mamba["dtype"] == "torch.int8" and mamba["shape"][1:] == [1, 1, state]
        assert mamba["stride"][0] == page  # the padded page
        assert attn["byte_offset"] == mamba["byte_offset"]  # groups overlay one tensor
        conv, ssm = (v["shape"][1:] for v in mamba["views"])  # conv: SD or DS layout
        assert sorted(conv) == [3, 64] and ssm == [64, 16]
