"""The spec's hypothesis machine: random walks of the spec with every invariant checked after
each step. Failures print the minimal action sequence. (Refinement of the reference and of
vLLM 0.33 against the spec: tests/conformance/test_refinement.py.)"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tailproof.spec.machines import SpecMachine


def test_spec_machine() -> None:
    run_state_machine_as_test(SpecMachine, settings=settings())


def test_spec_machine_steps_budget() -> None:
    """The spec machine takes at least 1,500 steps under the ``ci`` profile."""
    if settings().max_examples < 100:
        pytest.skip("step budget applies to the ci profile")
    if SpecMachine.steps == 0:
        run_state_machine_as_test(SpecMachine, settings=settings())
    print(f"spec machine steps: {SpecMachine.steps}")
    assert SpecMachine.steps >= 1500
