"""Property: random valid traces give identical observations (strict block ids) on the
reference model and vLLM 0.33. A divergence is shrunk by hypothesis and written to
``out/shrunk/`` as a trace ready to join the corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailproof.conformance.adapters import available
from tailproof.conformance.generate import LockstepDivergence, lockstep_trace, write_case

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
