"""Refinement machines: the reference and vLLM 0.33's ``KVCacheManager`` driven with random
scheduler-shaped op sequences, the spec's invariants checked on the abstraction of their state
after every op. Failures print the minimal op sequence."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tailproof.conformance.harness.refinement import RefinementMachine, VllmRefinementMachine

#: the spec tests' ``ci`` profile (tests/spec/conftest.py), pinned here so that this file
#: alone and the whole suite run the same examples
CI = settings(max_examples=120, stateful_step_count=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=True)


def test_refinement_reference() -> None:
    before = RefinementMachine.steps
    run_state_machine_as_test(RefinementMachine, settings=CI)
    steps = RefinementMachine.steps - before
    print(f"refinement steps: {steps}")
    assert steps >= 1500


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM 0.33 not installed")
def test_refinement_vllm() -> None:
    run_state_machine_as_test(VllmRefinementMachine, settings=settings(CI, max_examples=30))
