"""Fixtures of the benchmarks that need a real Mooncake master."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def master() -> Iterator[Any]:
    """A dedicated ``mooncake_master`` on 127.0.0.1 (skips, naming why, where Mooncake is
    not usable), stopped by PID afterwards."""
    from tailproof.conformance.harness.local_master import LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with LocalMaster() as m:
        yield m
