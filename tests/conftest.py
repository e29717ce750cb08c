"""Test-run network isolation: the whole run lives in a private loopback-only namespace.

The Mooncake client listens on every interface whatever it is told (see
``tailproof.conformance.harness.netns``), so before any test starts a thread, a client or a
master, the run moves into a fresh network namespace with only ``lo`` (root / CAP_SYS_ADMIN,
as on CI). The namespace has no name and goes away with the run. ``TAILPROOF_NETNS=0`` opts out;
``tests/impl/stores/test_listeners.py`` checks that nothing of the run listens beyond loopback.
"""

from __future__ import annotations

import pytest

from tailproof.conformance.harness import netns


def pytest_configure(config: pytest.Config) -> None:
    netns.isolation_error = netns.enter_loopback_namespace()
