"""Property: random valid traces give identical observations (strict block ids) on the
reference model and vLLM 0.33. A divergence is shrunk by hypothesis and written to
``out/shrunk/`` as a trace ready to join the corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailproof.conformance.harness.adapters import available
from tailproof.conformance.tools.generate import LockstepDivergence, lockstep_trace, write_case

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

EXAMPLES = int(os.environ.get("TAILPROOF_GENERATED_TRACES", "500"))
OUT = Path(os.environ.get("TAILPROOF_SHRUNK_DIR", "out/shrunk"))


@pytest.mark.skipif(not available("reference"), reason="tailproof.reference is not importable")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_reference_matches_vllm_on_generated_traces(data: st.DataObject) -> None:
    try:
        data.draw(lockstep_trace(["reference", "vllm"]))
    except LockstepDivergence as e:
        path = write_case(e.doc, OUT / "reference_vs_vllm.json")
        raise AssertionError(f"{e} (shrunk trace written to {path})") from None


@pytest.mark.skipif(not available("reference"), reason="tailproof.reference is not importable")
@settings(max_examples=max(1, EXAMPLES // 10), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_reference_matches_vllm_with_junction_checkpoint(data: st.DataObject) -> None:
    """The same with ``enable_mamba_shared_prefix_checkpoint`` on and EAGLE flagged on the
    Mamba groups: junction stops and junction keys, as vLLM 0.33 makes them."""
    try:
        data.draw(lockstep_trace(["reference", "vllm"], junction_checkpoint=True))
    except LockstepDivergence as e:
        path = write_case(e.doc, OUT / "reference_vs_vllm_junction.json")
        raise AssertionError(f"{e} (shrunk trace written to {path})") from None


def test_generated_traces_cover_every_core_op(capsys: pytest.CaptureFixture[str]) -> None:
    """The core generator's fixed budget reaches every core op and the new fields (drafts,
    rollback, Mamba speculative blocks); the coverage count is printed."""
    from collections import Counter

    from hypothesis import Phase

    from tailproof.conformance.format.ops import CORE_OPS

    coverage: Counter[str] = Counter()

    @settings(max_examples=80, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        run = data.draw(lockstep_trace(["reference"]))
        coverage.update(o["op"] for o in run.ops)
        coverage.update("plan_chunk.drafts" for o in run.ops if o.get("drafts"))
        coverage.update("rollback.rejected" for o in run.ops
                        if o["op"] == "rollback" and o["n"])
        coverage.update("allocate.delay_cache" for o in run.ops if o.get("delay_cache"))
        coverage.update("groups.sliding_window" for g in run.config_doc["groups"]
                        if "sliding_window" in g)
        coverage.update("groups.num_speculative_blocks" for g in run.config_doc["groups"]
                        if g.get("num_speculative_blocks"))

    draw()
    with capsys.disabled():
        print("\ncore generator op coverage over 80 traces: "
              + ", ".join(f"{k}={v}" for k, v in sorted(coverage.items())))
    # set_in_flight, truncate, reset and table are written by cases, not the generator
    wanted = set(CORE_OPS) - {"set_in_flight", "truncate", "reset", "table"}
    assert wanted | {"plan_chunk.drafts", "rollback.rejected", "allocate.delay_cache",
                     "groups.sliding_window", "groups.num_speculative_blocks"} <= set(coverage)
