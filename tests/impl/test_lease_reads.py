"""Reads that outlive their lease, on a real Mooncake master with a 500 ms read lease
(``--default_kv_lease_ttl``): a get whose lease expires mid-read -- Mooncake has returned bytes
after that (issues #3996, #4239) -- serves this key's verified bytes or fails closed (and the
writer's next save repairs the prefix), never wrong bytes, while puts and evictions run.

How a read outlives its lease, deterministically: a Mooncake get is two steps, the master's
lease grant (``batch_get_replica_desc``: the replica's address) and the transfer (with tcp on
one host a copy from that address in the segment, here this process's own). The test client
runs the real grant, then the step under test, then copies from the address the master granted
-- without the client's own lease check afterwards, i.e. what a client that hands out bytes
after its lease does. The steps are explicit: the lease is shown held (the master refuses a
lease-respecting removal of a key leased in the same grant: OBJECT_HAS_LEASE), then shown
expired (it accepts one: the only wait, the TTL under test, bounded by TTL + 10 s); then the
slot stays, is rewritten, is reused by another value, or is reclaimed by the master's own
eviction while puts fill the pool (bounded by a number of puts, not by time).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from stored_values import load, load_keys, loaded_right, read_value, save, untouched, worker

from tailproof.conformance.harness.local_master import LocalMaster
from tailproof.impl.stores import Store, make_store

pytestmark = pytest.mark.mooncake

LEASE_TTL_MS = 500
SEGMENT = 16 << 20  # Mooncake's smallest segment: the pool fills in a few thousand puts
OBJECT_HAS_LEASE = -706
SENTINEL = "lease-sentinel"  # leased in the same grant as the read: its lease shows the read's


class SplitGet:
    """A Mooncake client whose next ``batch_get_into`` runs as its two steps with ``between``
    in the middle; every other call (and later gets) go to the real client unchanged."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.between: Callable[[dict[str, tuple[int, int]]], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        step, self.between = self.between, None
        if step is None:
            return self._inner.batch_get_into(keys, ptrs, sizes)
        granted: dict[str, tuple[int, int]] = {}  # key -> (address, size) the master granted
        for key, replicas in self._inner.batch_get_replica_desc([*keys, SENTINEL]).items():
            mem = [r for r in replicas if r.is_memory_replica()]
            if mem:
                d = mem[0].get_memory_descriptor().buffer_descriptor
                granted[key] = (d.buffer_address, d.size)
        assert SENTINEL in granted, "the sentinel must be stored before the read"
        step(granted)
        codes = []
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            if key not in granted:
                codes.append(-704)  # OBJECT_NOT_FOUND
                continue
            address, stored = granted[key]
            if stored > size:
                codes.append(-600)  # INVALID_PARAMS: buffer too small, as get_into answers
                continue
            ctypes.memmove(ptr, address, stored)  # the transfer, after the lease
            codes.append(stored)
        return codes


def _slot_bytes(address: int, n: int) -> np.ndarray:
    """The bytes at ``address`` in this process's segment now (reading them takes no lease)."""
    return np.frombuffer((ctypes.c_uint8 * n).from_address(address), np.uint8).copy()


@pytest.fixture(scope="module")
def master(mooncake_available: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LocalMaster]:
    m = LocalMaster(tmp_path_factory.mktemp("lease"), lease_ttl_ms=LEASE_TTL_MS)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def store(master: LocalMaster) -> Iterator[Store]:
    s = make_store({"backend": "mooncake", "master_address": master.address,
                    "global_segment_size": SEGMENT, "local_buffer_size": SEGMENT,
                    "rpc_timeout_ms": 1500, "setup_retries": 1})
    s.remove_all()
    try:
        yield s
    finally:
        s.remove_all()
        s.close()


def _outlive_lease(client: Any) -> None:
    """Show the grant's lease held, then wait for it to expire (the TTL under test)."""
    assert client.remove(SENTINEL, False) == OBJECT_HAS_LEASE  # held: removal refused
    deadline = time.monotonic() + LEASE_TTL_MS / 1000 + 10.0
    tick = threading.Event()  # never set: a bounded pause between asks, not a synchronisation
    while client.remove(SENTINEL, False) != 0:  # accepted only once the lease expired
        assert time.monotonic() < deadline, "the read lease never expired"
        tick.wait(0.02)


SCENARIOS = ("intact", "rewritten by its writer", "reused by another value",
             "evicted while puts fill the pool")
#: scenario -> the read serves this key's verified bytes (True) or fails closed (False)
SERVED = {"intact": True, "rewritten by its writer": True, "reused by another value": False,
          "evicted while puts fill the pool": False}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_read_that_outlives_its_lease_serves_verified_bytes_or_fails_closed(
        store: Store, scenario: str) -> None:
    w, runner = worker(store)
    save(w, runner)
    keys = load_keys(w)
    g, victim = keys[0]  # the first attention value of the prefix
    n = w._slot(g)
    good = read_value(store, victim, n)
    other = read_value(store, keys[1][1], n)  # a valid value of another key, the same size
    assert store.put(SENTINEL, np.zeros(64, np.uint8)).ok
    client = store._client = SplitGet(store._client)
    fillers: list[str] = []
    seen: dict[str, Any] = {}

    def step(granted: dict[str, tuple[int, int]]) -> None:
        address, size = granted[victim]
        assert size == n and np.array_equal(_slot_bytes(address, n), good)
        _outlive_lease(client)
        if scenario == "rewritten by its writer":
            assert client.remove(victim, False) == 0  # its lease expired too
            assert store.put(victim, good).ok
            again = client.batch_get_replica_desc([victim])[victim][0]
            assert again.get_memory_descriptor().buffer_descriptor.buffer_address == address
        elif scenario == "reused by another value":
            assert client.remove(victim, False) == 0
            assert store.put("another-prefix", other).ok
            fillers.append("another-prefix")
        elif scenario == "evicted while puts fill the pool":
            bound = 8 * SEGMENT // n  # puts; the master evicts expired values as the pool fills
            batch = 64
            while np.array_equal(_slot_bytes(address, n), good):
                assert len(fillers) < bound, "the master never evicted the expired value"
                names = [f"filler-{len(fillers) + i}" for i in range(batch)]
                store.put_batch(names, [other] * batch)  # full answers are fine: it evicts
                fillers.extend(names)
        seen["slot"] = _slot_bytes(address, n)

    client.between = step
    r, rrun = worker(store)
    ok, before = load(r, rrun)
    assert "slot" in seen, "the load never read"
    changed = not np.array_equal(seen["slot"], good)
    assert changed == (not SERVED[scenario])  # the scenario did what it names
    failures = {k: v for k, v in r.metrics.c.totals().items() if k.startswith("verify_fail_")}
    if ok:  # only ever this key's verified bytes
        assert not changed and loaded_right(rrun) and not failures
    else:  # fail closed: counted, nothing scattered
        assert changed and untouched(rrun, before) and failures
    assert ok == SERVED[scenario]

    # The writer's next save makes the next load (the real client's get) a verified hit.
    store.remove(fillers)
    save(w, runner, job=1)
    r2, rrun2 = worker(store)
    ok, _ = load(r2, rrun2)
    assert ok and loaded_right(rrun2)
