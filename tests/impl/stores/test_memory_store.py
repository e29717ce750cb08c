"""MemoryStore specifics: capacity accounting, LRU eviction, scripted faults."""

from __future__ import annotations

import numpy as np
import pytest
from storetest_helpers import pattern

from tailproof.impl.stores import MemoryStore, Outcome, Status


def test_capacity_accounting_and_too_large() -> None:
    s = MemoryStore(10_000, evict=False)
    assert s.put("a", pattern(0, 6000)).ok and s.used_bytes == 6000
    assert s.put("b", pattern(1, 6000)).status is Status.STORE_FULL
    assert s.put("huge", pattern(2, 10_001)).status is Status.TOO_LARGE
    assert s.put("c", pattern(3, 4000)).ok and s.used_bytes == 10_000
    s.remove_all()
    assert s.used_bytes == 0 and s.put("b", pattern(1, 6000)).ok


def test_eviction_drops_least_recently_used() -> None:
    s = MemoryStore(3000)
    for k in "abc":
        assert s.put(k, pattern(ord(k), 1000)).ok
    assert s.get("a", np.zeros(1000, np.uint8)).ok  # a is now most recent
    assert s.put("d", pattern(9, 1000)).ok  # evicts b, the least recently used
    assert s.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert s.used_bytes == 3000
    assert s.put("e", pattern(9, 3001)).status is Status.TOO_LARGE  # never evicts for that


def test_values_are_private_copies() -> None:
    s = MemoryStore(1 << 20)
    src = pattern(0, 100)
    s.put("k", src)
    expect = src.copy()
    src[:] = 0  # the caller reuses its staging buffer
    buf = np.zeros(100, np.uint8)
    assert s.get("k", buf).ok
    np.testing.assert_array_equal(buf, expect)


def test_fault_script_replaces_next_outcomes_in_order() -> None:
    s = MemoryStore(1 << 20)
    s.put("k", pattern(0, 10))
    s.faults.script("get", [Outcome.timeout(), None, Status.MISS])
    s.faults.script("put", [Status.STORE_FULL])
    s.faults.script("exists", [Outcome.error()])
    bufs = [np.zeros(10, np.uint8) for _ in range(4)]
    got = s.get_batch(["k"] * 4, bufs)
    assert [o.status for o in got] == [Status.TIMEOUT, Status.OK, Status.MISS, Status.OK]
    assert s.put("new", pattern(1, 10)).status is Status.STORE_FULL
    assert s.exists(["k", "k"]) == [False, True]
    assert s.put("new", pattern(1, 10)).ok  # script used up: real behaviour again


def test_fault_script_down_fails_everything_closed() -> None:
    s = MemoryStore(1 << 20)
    s.put("k", pattern(0, 10))
    s.faults.down = True
    assert s.get("k", np.zeros(10, np.uint8)).status is Status.ERROR
    assert s.put("x", pattern(0, 10)).status is Status.ERROR
    assert s.exists(["k"]) == [False]
    s.faults.clear()
    assert s.get("k", np.zeros(10, np.uint8)).ok
    with pytest.raises(ValueError):
        s.faults.script("delete", [Status.OK])


def test_bad_capacity() -> None:
    with pytest.raises(ValueError):
        MemoryStore(0)


def test_reused_arrays_stay_within_capacity_and_hold_new_bytes() -> None:
    s = MemoryStore(10_000)
    for round_ in range(5):
        sizes = [3000, 3000, 2000] if round_ % 2 else [5000, 1000, 4000]
        vals = [pattern(round_ * 10 + i, n) for i, n in enumerate(sizes)]
        assert all(o.ok for o in s.put_batch(["a", "b", "c"], vals))
        assert s.reserved_bytes <= s.capacity_bytes
        for k, v in zip("abc", vals, strict=True):
            buf = np.zeros(v.size, np.uint8)
            assert s.get(k, buf).ok
            np.testing.assert_array_equal(buf, v)
        s.remove_all()
        assert s.used_bytes == 0 and s.reserved_bytes <= s.capacity_bytes


def test_change_count_moves_with_every_key_added_or_dropped() -> None:
    """``change_count`` (what lets a remembered lookup ask nothing): a new key, an eviction and
    a removal each move it; a write-once duplicate, a read and an ``exists`` do not; scripted
    ``exists`` answers (or a closed store) make it unknown."""
    s = MemoryStore(2000)
    c0 = s.change_count()
    assert c0 == 0
    assert s.put("a", pattern(0, 1000)).ok and s.change_count() == 1
    assert s.put("a", pattern(0, 1000)).status is Status.EXISTS and s.change_count() == 1
    s.exists(["a", "b"])
    assert s.get("a", np.zeros(1000, np.uint8)).ok and s.change_count() == 1
    assert s.put("b", pattern(1, 1000)).ok and s.change_count() == 2
    assert s.put("c", pattern(2, 1000)).ok and s.change_count() == 4  # c added, a evicted
    assert s.remove(["b", "zz"]) == 1 and s.change_count() == 5
    s.faults.script("exists", [Outcome(Status.OK)])
    assert s.change_count() is None
    s.exists(["zz"])  # the scripted answer is used up
    assert s.change_count() == 5
    s.close()
    assert s.change_count() is None
