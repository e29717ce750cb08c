"""Store fixtures: ``store`` runs a test once per backend (memory, mooncake on a real master)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from storetest_helpers import MIB, mooncake_config

from tailproof.impl.stores import MemoryStore, Store, make_store


@pytest.fixture(scope="session")
def mooncake_session_store(mooncake_master: str) -> Iterator[Store]:
    """One Mooncake client for the session (a client's close() costs about 1 s)."""
    store = make_store(mooncake_config(mooncake_master))
    yield store
    store.close()


@pytest.fixture(params=["memory", "mooncake"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A clean store of each backend; emptied after the test."""
    if request.param == "memory":
        with MemoryStore(64 * MIB) as s:
            yield s
        return
    s = request.getfixturevalue("mooncake_session_store")
    s.remove_all()
    yield s
    s.remove_all()


@pytest.fixture(params=["memory", "mooncake"])
def store_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Store]]:
    """Build private stores of each backend (tests of close(), capacity); closed afterwards.

    Called with memory-store kwargs, e.g. ``store_factory(capacity_bytes=..., evict=False)``;
    for mooncake each call gets its own master, so its segment is the whole pool."""
    made: list[Store] = []
    # Requested now, so the masters outlive the clients (stopped after they close).
    masters = (request.getfixturevalue("mooncake_master_factory")
               if request.param == "mooncake" else None)

    def build(capacity_bytes: int = 64 * MIB, evict: bool = True) -> Store:
        if request.param == "memory":
            s: Store = MemoryStore(capacity_bytes, evict=evict)
        else:
            assert masters is not None
            master = masters()
            s = make_store(mooncake_config(master.address, global_segment_size=capacity_bytes))
        made.append(s)
        return s

    yield build
    for s in made:
        s.close()
