"""Shared fixtures of the real-engine suite: the workload and its ground truth (one engine with
prefix caching off, started once per session)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 or 0.34 (./scripts/bootstrap.sh)")

from tailproof.conformance.realengine import oracle  # noqa: E402

MAX_TOKENS = oracle.MAX_TOKENS


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return oracle.shared_prefix_prompts(seed=0)


@pytest.fixture(scope="session")
def truth(prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return oracle.ground_truth(prompts, MAX_TOKENS)
