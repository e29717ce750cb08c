"""The Store contract (impl/stores/base.py), run against every backend."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from storetest_helpers import MIB, pattern

from tailproof.impl.stores import Outcome, Status, Store


def test_roundtrip_batch_of_numpy_views(store: Store) -> None:
    vals = [pattern(i, 4096 * (i + 1)) for i in range(4)]
    keys = [f"k{i}" for i in range(4)]
    assert [o.status for o in store.put_batch(keys, vals)] == [Status.OK] * 4
    outs = [np.zeros_like(v) for v in vals]
    res = store.get_batch(keys, outs)
    assert all(o.ok for o in res)
    assert [o.nbytes for o in res] == [v.nbytes for v in vals]
    for v, o in zip(vals, outs, strict=True):
        np.testing.assert_array_equal(v, o)


def test_buffer_kinds_roundtrip_as_raw_bytes(store: Store) -> None:
    # float32 numpy, bf16 torch and a memoryview are all their nbytes, never len() elements.
    f32 = np.arange(1024, dtype=np.float32)
    bf16 = torch.arange(2048, dtype=torch.bfloat16)
    mv = memoryview(bytearray(pattern(7, 3000).tobytes()))
    outs = store.put_batch(["f32", "bf16", "mv"], [f32, bf16, mv])
    assert [o.nbytes for o in outs] == [4096, 4096, 3000]
    got_f32, got_mv = np.zeros(1024, np.float32), bytearray(3000)
    got_bf16 = torch.zeros(2048, dtype=torch.bfloat16)
    assert all(o.ok for o in store.get_batch(["f32", "bf16", "mv"], [got_f32, got_bf16, got_mv]))
    np.testing.assert_array_equal(got_f32, f32)
    assert torch.equal(got_bf16, bf16)
    assert bytes(got_mv) == bytes(mv)


def test_put_is_write_once(store: Store) -> None:
    first, second = pattern(1, 1000), pattern(2, 1000)
    assert store.put("k", first).status is Status.OK
    again = store.put("k", second)
    assert again.status is Status.EXISTS and again.saved and not again.ok
    buf = np.zeros(1000, np.uint8)
    assert store.get("k", buf).ok
    np.testing.assert_array_equal(buf, first)


def test_repeated_key_inside_one_batch_is_written_once(store: Store) -> None:
    a, b = pattern(1, 512), pattern(2, 512)
    assert [o.status for o in store.put_batch(["d", "d"], [a, b])] == [Status.OK, Status.EXISTS]
    buf = np.zeros(512, np.uint8)
    assert store.get("d", buf).ok
    np.testing.assert_array_equal(buf, a)


def test_miss_is_reported_even_when_buffer_holds_valid_looking_bytes(store: Store) -> None:
    v = pattern(3, 2048)
    store.put("present", v)
    buf = np.zeros(2048, np.uint8)
    assert store.get("present", buf).ok  # buf now holds exactly a valid value ...
    res = store.get_batch(["absent", "present"], [buf, np.zeros(2048, np.uint8)])
    assert res[0].status is Status.MISS and not res[0].ok  # ... but the miss says so
    assert res[1].ok


def test_exists(store: Store) -> None:
    store.put("a", pattern(0, 100))
    assert store.exists(["a", "b", "a"]) == [True, False, True]
    assert store.exists([]) == []


def test_size_mismatch_is_not_ok(store: Store) -> None:
    store.put("k", pattern(4, 4096))
    small, large = np.zeros(1000, np.uint8), np.zeros(8192, np.uint8)
    assert store.get("k", small).status is Status.WRONG_SIZE
    assert store.get("k", large).status is Status.WRONG_SIZE  # tail would be stale bytes


def test_remove_all_then_everything_misses(store: Store) -> None:
    store.put_batch(["x", "y"], [pattern(0, 64), pattern(1, 64)])
    assert store.remove_all() == 2
    assert store.exists(["x", "y"]) == [False, False]
    assert store.get("x", np.zeros(64, np.uint8)).status is Status.MISS


def test_registered_staging_buffer_views(store: Store) -> None:
    staging = torch.zeros(4 * MIB, dtype=torch.uint8)
    store.register_buffer(staging)
    try:
        views = [staging[i * MIB:(i + 1) * MIB] for i in range(4)]
        for i, v in enumerate(views):
            v.copy_(torch.from_numpy(pattern(i, MIB)))
        assert all(o.ok for o in store.put_batch([f"s{i}" for i in range(4)], views))
        expect = staging.clone()
        staging.zero_()
        assert all(o.ok for o in store.get_batch([f"s{i}" for i in range(3, -1, -1)],
                                                 views[::-1]))
        assert torch.equal(staging, expect)
    finally:
        store.unregister_buffer(staging)


def test_empty_batches(store: Store) -> None:
    assert store.put_batch([], []) == [] and store.get_batch([], []) == []


def test_malformed_batches_raise(store: Store) -> None:
    with pytest.raises(ValueError):
        store.put_batch(["a", "b"], [b"x"])
    with pytest.raises(ValueError):
        store.put_batch([""], [b"x"])
    with pytest.raises(ValueError):
        store.get_batch(["a"], [b"readonly"])
    with pytest.raises(TypeError):
        store.put_batch(["a"], [np.zeros((4, 4), np.uint8)[:, 1]])


def test_concurrent_threads(store: Store) -> None:
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(20):
            key, val = f"t{t}-{i}", pattern(t * 100 + i, 8192)
            if not store.put(key, val).ok:
                errors.append(f"put {key}")
            buf = np.zeros(8192, np.uint8)
            if not store.get(key, buf).ok or not np.array_equal(buf, val):
                errors.append(f"get {key}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_closed_store_fails_closed(store_factory: Callable[..., Store]) -> None:
    s = store_factory()
    with s:
        assert s.put("k", pattern(0, 100)).ok
    s.close()  # idempotent
    assert s.put("k2", pattern(0, 100)).status is Status.ERROR
    assert s.get("k", np.zeros(100, np.uint8)).status is Status.ERROR
    assert s.exists(["k"]) == [False]


def test_store_full(store_factory: Callable[..., Store]) -> None:
    """Filling past capacity answers STORE_FULL; what was stored reads back or misses."""
    s = store_factory(capacity_bytes=16 * MIB, evict=False)
    vals = [pattern(i, MIB) for i in range(24)]
    res = s.put_batch([f"f{i}" for i in range(24)], vals)
    statuses = {o.status for o in res}
    assert Status.STORE_FULL in statuses and statuses <= {Status.OK, Status.STORE_FULL}
    assert res[0].ok
    assert res[-1] == Outcome.full(res[-1].code, res[-1].message)
    for i, o in enumerate(res):
        if o.ok:
            buf = np.zeros(MIB, np.uint8)
            got = s.get(f"f{i}", buf)
            assert got.status in (Status.OK, Status.MISS)  # Mooncake may evict unread values
            if got.ok:
                np.testing.assert_array_equal(buf, vals[i])
