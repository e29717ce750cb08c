"""Differential runs against vLLM 0.33 objects in strict-id mode (all marked ``vllm``)."""

from __future__ import annotations

import glob
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from ref_fuzz import first_divergence, gen_chaos_trace, gen_trace

from tailproof.reference.geometry import Geometry, GroupSpec
from tailproof.reference.request import Request
from tailproof.reference.scheduler_split import mamba_block_aligned_split

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", range(60))
def test_random_traces_agree_with_vllm(seed: int) -> None:
    doc = gen_trace(seed)
    assert first_divergence(doc) is None, doc["config"]


@pytest.mark.parametrize("seed", range(40))
def test_chaos_traces_agree_with_vllm(seed: int) -> None:
    """Ops in any order with any arguments: errors and their side effects agree too."""
    doc = gen_chaos_trace(seed)
    assert first_divergence(doc) is None, doc["config"]


def test_conformance_core_cases_agree_with_vllm() -> None:
    from tailproof.conformance.format.trace import load_trace
    from tailproof.conformance.harness.replay import run_trace

    paths = sorted(glob.glob(str(ROOT / "conformance" / "cases" / "core_*.json")))
    if not paths:
        pytest.skip("no core cases")
    bad = []
    for p in paths:
        result = run_trace(load_trace(p), ["reference", "vllm"], strict=True)
        bad += [d.as_json() for d in result.divergences]
    assert bad == []


def test_split_matches_vllm_scheduler() -> None:
    """The reference split against ``Scheduler._mamba_block_aligned_split`` on a stand-in self
    with the attributes the engine derives."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request as VRequest

    rng = random.Random(7)
    for _ in range(400):
        h = rng.choice([1, 2, 4, 8])
        bs = h * rng.choice([1, 2, 4])
        use_eagle = rng.random() < 0.3
        g = Geometry(groups=(GroupSpec("full_attention", bs), GroupSpec("mamba_align", bs)),
                     hash_block_size=h, num_blocks=8, use_eagle=use_eagle,
                     max_num_scheduled_tokens=rng.choice([4, 8, 64]),
                     long_prefill_token_threshold=rng.choice([0, 0, 3, 6]))
        stand_in = SimpleNamespace(
            block_size=g.scheduler_block_size,
            cache_config=SimpleNamespace(block_size=g.cache_config_block_size),
            hash_block_size=h, max_num_scheduled_tokens=g.max_num_scheduled_tokens,
            scheduler_config=SimpleNamespace(
                long_prefill_token_threshold=g.long_prefill_token_threshold),
            use_eagle_block_drop=use_eagle, num_hash_lookahead_tokens=0,
            mamba_partial_cache_hit=g.mamba_partial_cache_hit,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None, mamba_shared_prefix_checkpoint=False)
        p = rng.randrange(1, 60)
        outputs = rng.choice([0, 0, 3])
        start = rng.randrange(0, p + outputs)
        want = rng.randrange(1, 70)
        sp = SamplingParams(max_tokens=4)
        sp.update_from_generation_config({}, eos_token_id=None)
        vr = VRequest("r", [1] * p, sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(h, sha256))
        rr = Request("r", [1] * p, h)
        if outputs:
            vr.append_output_token_ids([2] * outputs)
            rr.append_output_token_ids([2] * outputs)
        vr.num_computed_tokens = rr.num_computed_tokens = start
        expect = Scheduler._mamba_block_aligned_split(stand_in, vr, want, 0, 0)
        assert mamba_block_aligned_split(g, rr, want) == expect, (g, p, outputs, start, want)

# The reference's speed against vLLM's (at least half) is a benchmark:
# benchmarks/test_core_throughput.py::test_reference_at_least_half_as_fast_as_vllm.
