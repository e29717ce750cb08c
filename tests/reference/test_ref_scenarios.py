"""C1..C10 (docs/citations.md): the exact vLLM 0.33 block ids, on the reference and (marked
``vllm``) on vLLM itself through the conformance driver."""

from __future__ import annotations

from typing import Any

import pytest
from ref_scenarios import all_scenarios

from tailproof.conformance.format.compare import subset_match
from tailproof.conformance.format.trace import parse_trace
from tailproof.conformance.harness.adapters import make_driver

SCENARIOS = all_scenarios()


def run_expectations(doc: dict[str, Any], adapter: str) -> list[str]:
    trace = parse_trace(doc)
    driver = make_driver(adapter, trace.config)
    problems = []
    for i, op in enumerate(trace.ops):
        obs = driver.apply(op)
        if "expect" in op and not subset_match(op["expect"], obs):
            problems.append(f"op {i} {op['op']}: expected {op['expect']}, got {obs}")
    return problems


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_matches_vllm_ids(name: str) -> None:
    assert run_expectations(SCENARIOS[name], "reference") == []


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_vllm_agrees_with_recorded_ids(name: str) -> None:
    assert run_expectations(SCENARIOS[name], "vllm") == []
