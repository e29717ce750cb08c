"""The spec's hypothesis machines: random walks of the spec, and refinement of the reference
(and of vLLM 0.33 when it is installed). Failures print the minimal op sequence."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tailproof.spec.machines import STEPS, RefinementMachine, SpecMachine

VLLM_CORE = "tailproof.conformance.adapters.vllm_core:VllmCoreBackend"


def test_spec_machine() -> None:
    run_state_machine_as_test(SpecMachine, settings=settings())


def test_refinement_reference() -> None:
    run_state_machine_as_test(RefinementMachine, settings=settings())


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM 0.33 not installed")
def test_refinement_vllm() -> None:
    class VllmRefinement(RefinementMachine):
        backend_path = VLLM_CORE

    run_state_machine_as_test(VllmRefinement, settings=settings(max_examples=30))


def test_steps_budget() -> None:
    """Both machines together take at least 2,000 steps under the ``ci`` profile."""
    if settings().max_examples < 100:
        pytest.skip("step budget applies to the ci profile")
    if STEPS["spec"] == 0:
        run_state_machine_as_test(SpecMachine, settings=settings())
    if STEPS["refinement"] == 0:
        run_state_machine_as_test(RefinementMachine, settings=settings())
    print(f"hypothesis steps: {STEPS}")
    assert STEPS["spec"] + STEPS["refinement"] >= 2000
