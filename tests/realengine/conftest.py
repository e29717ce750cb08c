"""Shared fixtures of the real-engine suite: the workload and its ground truth (one engine with
prefix caching off, started once per session), and a real Mooncake master per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``mooncake_master`` on 127.0.0.1 for one module. Its read lease outlives the slowest
    read of several engine processes on a loaded machine: the tests check passes served from
    the store, and a read past its lease fails closed (``local_master.SLOW_READ_LEASE_TTL_MS``)."""
    from tailproof.conformance.harness.local_master import SLOW_READ_LEASE_TTL_MS, LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"Mooncake client unavailable: {reason}")
    m = LocalMaster(tmp_path_factory.mktemp("mooncake"),
                    lease_ttl_ms=SLOW_READ_LEASE_TTL_MS).start()
    try:
        yield m
    finally:
        m.stop()
