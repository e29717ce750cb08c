"""Test-run network isolation: the whole run lives in a private loopback-only namespace.

The Mooncake client listens on every interface whatever it is told (see
``tailproof.conformance.harness.netns``), so before any test starts a thread, a client or a
master, the run moves into a fresh network namespace with only ``lo`` (root / CAP_SYS_ADMIN,
as on CI). The namespace has no name and goes away with the run. ``TAILPROOF_NETNS=0`` opts out;
``tests/impl/stores/test_listeners.py`` checks that nothing of the run listens beyond loopback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tailproof.conformance.harness import netns


def pytest_configure(config: pytest.Config) -> None:
    netns.isolation_error = netns.enter_loopback_namespace()


@pytest.fixture(autouse=True)
def _stores_do_not_outlive_their_test() -> Iterator[None]:
    """A store an earlier test left acquired (``impl.connector.acquire_store`` shares one per
    configuration per process) must not serve its keys to a later test's engine: the later
    test would see hits its trace does not model (the order effect that doubled hit counts).
    Stores acquired during a test and still held at its end are closed and dropped."""
    mod = sys.modules.get("tailproof.impl.connector")
    before = set(mod._SHARED) if mod is not None else set()
    yield
    mod = sys.modules.get("tailproof.impl.connector")
    if mod is None:
        return
    with mod._SHARED_LOCK:
        leaked = [k for k in mod._SHARED if k not in before]
        stores = [mod._SHARED.pop(k)[0] for k in leaked]
    for store in stores:
        store.close()
