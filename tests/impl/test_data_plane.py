"""The data plane's parts: lanes (order, bound, shutdown, manual drive), one-pass store calls,
and the worker's promise that the step never waits for the store."""

from __future__ import annotations

import os
import random
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tailproof.impl.data_plane import Lanes, StagingPool
from tailproof.impl.meta import BoundaryPut, StoreJob, TailproofMeta
from tailproof.impl.stores import MemoryStore, Outcome, Status

# --------------------------------------------------------------------------- lanes


def test_lanes_keep_per_key_order_and_run_keys_apart() -> None:
    """Driven by hand in a seeded random interleaving of the lanes (no timing): each key's
    jobs run in submission order on its own lane, and a lane runs without waiting for the
    others (all of one lane's jobs finish while another's are still queued)."""
    seen: list[tuple[str, int]] = []
    lanes: Lanes[tuple[str, int]] = Lanes("t", seen.append, lambda j: None, threads=3,
                                          max_queued=100, manual=True)
    for i in range(10):
        for k in ("a", "b", "c"):
            assert lanes.submit(k, (k, i))
    lane_b = lanes.lane_of("b")
    assert lane_b != lanes.lane_of("a")
    while lanes.run_next(lane_b) is not None:  # lane b runs out while a's lane is held
        pass
    assert [j for j in seen if j[0] == "b"] == [("b", i) for i in range(10)]
    assert all(k != "b" for k, _ in lanes.queued()) and len(lanes.queued()) == 20
    rng = random.Random(7)
    while lanes.queued():
        lanes.run_next(rng.randrange(3))
    for k in ("a", "b", "c"):
        assert [i for kk, i in seen if kk == k] == list(range(10))
    assert lanes.close() == 0


def test_full_lanes_refuse_instead_of_blocking() -> None:
    gate = threading.Event()
    finished: list[int] = []

    def run(job: int) -> None:
        gate.wait(60)
        finished.append(job)

    lanes: Lanes[int] = Lanes("t", run, lambda j: None, max_queued=2)
    assert lanes.submit("k", 1) and lanes.submit("k", 2)
    assert not lanes.submit("k", 3)  # full: refused ...
    assert finished == []  # ... while the gate still holds the worker: it did not wait for it
    gate.set()
    assert lanes.wait_idle(10) and lanes.submit("k", 4)
    lanes.close()


def test_close_finishes_queued_jobs_or_abandons_them() -> None:
    ran: list[int] = []
    abandoned: list[int] = []
    lanes: Lanes[int] = Lanes("t", ran.append, abandoned.append, max_queued=10)
    for i in range(5):
        lanes.submit("k", i)
    assert lanes.close(timeout=10) == 0 and sorted(ran) == list(range(5)) and not abandoned
    # A store that never answers: the running job is left to finish, the queued ones are
    # abandoned (reported by the caller), nothing is lost.
    # The store answers only once close has given up (at the first abandon): no timing.
    started, stuck = threading.Event(), threading.Event()
    ran2: list[int] = []

    def run(job: int) -> None:
        started.set()
        assert stuck.wait(60)
        ran2.append(job)

    def abandon(job: int) -> None:
        abandoned.append(job)
        stuck.set()

    lanes2: Lanes[int] = Lanes("t", run, abandon, max_queued=10)
    for i in range(4):
        lanes2.submit("k", i)
    assert started.wait(30)  # job 0 is running (held) before close starts
    assert lanes2.close(timeout=0.1) == 3
    assert lanes2.wait_idle(30)  # the held job finishes once released
    assert abandoned == [1, 2, 3] and ran2 == [0]
    assert not lanes2.submit("k", 9)  # closed


def test_manual_lanes_run_exactly_the_jobs_handed_out() -> None:
    ran: list[int] = []
    lanes: Lanes[int] = Lanes("t", ran.append, lambda j: None, manual=True)
    for i in range(3):
        lanes.submit("k", i)
    assert ran == [] and [j for j in lanes.queued()] == [0, 1, 2]
    assert lanes.run_next() == 0 and ran == [0]
    assert lanes.run_next() == 1 and ran == [0, 1]
    lanes.close()
    assert ran == [0, 1, 2]  # a closing engine runs out what is queued


def test_staging_pool_waits_for_a_free_buffer_and_never_deadlocks_on_size() -> None:
    pool = StagingPool(1, 1024)
    order: list[str] = []

    waiting = threading.Event()

    class SeenWaiting(threading.Condition):
        """The pool's condition, telling the test when a taker starts waiting on it."""

        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    pool._cond = SeenWaiting()  # no taker yet: swapping the pool's condition is safe

    def other() -> None:
        with pool.take(100):
            order.append("other")

    with pool.take(1024) as buf:
        assert buf.numel() == 1024
        t = threading.Thread(target=other)
        t.start()
        assert waiting.wait(30)  # the other taker is blocked on the only buffer ...
        order.append("first")  # ... until this one is given back
    t.join(30)
    assert order == ["first", "other"]
    with pool.take(4096) as big:  # larger than any pooled buffer: a temporary one
        assert big.numel() == 4096 and pool.oversize == 1


# --------------------------------------------------------------------------- one pass


def test_memory_store_write_batch_fills_the_stored_array_itself() -> None:
    store = MemoryStore(1 << 20)
    targets: list[int] = []

    def produce(i: int, out: np.ndarray) -> None:
        targets.append(out.ctypes.data)
        out[:] = i + 1

    outs = store.write_batch(["a", "b"], [100, 200], produce)
    assert [o.status for o in outs] == [Status.OK, Status.OK]
    assert [store._data[k].ctypes.data for k in ("a", "b")] == targets  # no second copy
    seen: list[int] = []

    def consume(values: list[np.ndarray]) -> None:
        seen.extend(v.ctypes.data for v in values)
        assert not values[0].flags.writeable
        assert (values[0] == 1).all() and (values[1] == 2).all()

    assert all(o.ok for o in store.read_batch(["a", "b"], [100, 200], consume))
    assert seen == targets  # read straight out of the store's arrays
    # Write-once: a second write of a key produces nothing.
    assert store.write_batch(["a"], [100], lambda i, o: pytest.fail("produced"))[0].status \
        is Status.EXISTS


def test_read_batch_is_all_or_nothing() -> None:
    store = MemoryStore(1 << 20)
    store.put_batch(["a"], [np.ones(10, np.uint8)])
    outs = store.read_batch(["a", "missing"], [10, 10], lambda v: pytest.fail("consumed"))
    assert [o.status for o in outs] == [Status.OK, Status.MISS]
    store.faults.script("get", [Outcome.timeout()])
    outs = store.read_batch(["a"], [10], lambda v: pytest.fail("consumed"))
    assert outs[0].status is Status.TIMEOUT


def test_a_value_removed_while_read_is_never_recycled_under_the_reader() -> None:
    store = MemoryStore(1 << 20)
    store.put_batch(["a"], [np.full(64, 7, np.uint8)])

    def consume(values: list[np.ndarray]) -> None:
        store.remove_all()  # evicted mid-read ...
        store.put_batch(["b"], [np.full(64, 9, np.uint8)])  # ... and the space reused
        assert (values[0] == 7).all()  # the reader's bytes did not change

    assert store.read_batch(["a"], [64], consume)[0].ok
    assert store.reserved_bytes <= store.capacity_bytes


def test_default_write_and_read_batch_go_through_staging() -> None:
    """A store without its own allocate-then-fill (the base class path, e.g. Mooncake):
    produce into the caller's staging views, then put; get into staging, then consume."""
    from tailproof.impl.stores.base import Store

    class Plain(Store):
        def __init__(self) -> None:
            self.m = MemoryStore(1 << 20)
            self.put_ptrs: list[int] = []

        def exists(self, keys: Sequence[str]) -> list[bool]:
            return self.m.exists(keys)

        def put_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
            self.put_ptrs += [b.ctypes.data for b in buffers]
            return self.m.put_batch(keys, buffers)

        def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
            return self.m.get_batch(keys, buffers)

        def remove(self, keys: Sequence[str]) -> int:
            return self.m.remove(keys)

        def remove_all(self) -> int:
            return self.m.remove_all()

        def close(self) -> None:
            self.m.close()

    s = Plain()
    staging = np.zeros(1000, np.uint8)
    s.write_batch(["x", "y"], [10, 20], lambda i, o: o.fill(i + 3), staging=staging)
    assert s.put_ptrs == [staging.ctypes.data, staging.ctypes.data + 10]
    got: list[np.ndarray] = []
    outs = s.read_batch(["x", "y"], [10, 20], lambda v: got.extend(x.copy() for x in v),
                        staging=staging)
    assert all(o.ok for o in outs) and (got[0] == 3).all() and (got[1] == 4).all()


# --------------------------------------------------------------------------- the worker


class BlockingStore(MemoryStore):
    """A memory store whose writes wait until ``release`` is set (a slow network)."""

    def __init__(self) -> None:
        super().__init__(1 << 26)
        self.release = threading.Event()
        self.writing = threading.Event()

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Any,
                    staging: Any = None) -> list[Outcome]:
        self.writing.set()
        assert self.release.wait(30)
        return super().write_batch(keys, sizes, produce, staging)


def returns_while_held(call: Callable[[], Any], gate: threading.Event) -> None:
    """``call`` returns while ``gate`` (the store's answer) is still unset: the structural
    form of "does not wait for the store" (no time bound). Run on a helper thread so that a
    call that did wait fails the test instead of hanging it."""
    returned = threading.Event()
    errors: list[BaseException] = []

    def go() -> None:
        try:
            call()
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)
        returned.set()

    th = threading.Thread(target=go)
    th.start()
    assert returned.wait(30), "the call waited for the store"
    assert not gate.is_set()  # nothing released the store meanwhile
    th.join()
    if errors:
        raise errors[0]


def _worker(store: Any, **kw: Any) -> tuple[Any, Any]:
    from test_worker_side import make_worker

    return make_worker(store, **kw)


TABLES = ([1, 2, 3], [0, 0, 6])


def _job(jid: int, rid: str = "A") -> StoreJob:
    from test_worker_side import HASHES, save

    return save(jid, rid, 32, TABLES, HASHES, [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)])


def test_wait_for_save_returns_while_the_put_is_still_running() -> None:
    from test_worker_side import TOKENS

    store = BlockingStore()
    w, runner = _worker(store)
    runner.forward("A", TOKENS, 0, 44, TABLES)
    returns_while_held(lambda: w.wait_for_save(TailproofMeta(stores=[_job(0)])), store.release)
    assert store.writing.wait(10)
    assert w.build_connector_worker_meta() is None  # not reported while the put runs: pins held
    store.release.set()
    assert w.wait_idle(10)
    assert w.build_connector_worker_meta().completed_saves == {0: 1}
    w.close()


def test_full_queue_skips_the_job_and_reports_it_at_once() -> None:
    store = BlockingStore()
    w, runner = _worker(store, max_queued_jobs=1)
    w.wait_for_save(TailproofMeta(stores=[_job(0), _job(1, "B")]))
    assert w.metrics.c.total("jobs_skipped_queue_full") == 1
    # The skipped job is reported at once, nothing else yet.
    assert w.build_connector_worker_meta().completed_saves == {1: 1}
    store.release.set()
    assert w.wait_idle(10) and w.build_connector_worker_meta().completed_saves == {0: 1}
    w.close()


def test_close_reports_every_queued_job() -> None:
    store = BlockingStore()
    w, runner = _worker(store)
    w.wait_for_save(TailproofMeta(stores=[_job(i) for i in range(4)]))
    assert store.writing.wait(10)
    inc = w.metrics.c.inc

    def release_at_first_abandon(name: str, n: int = 1) -> None:
        inc(name, n)
        if name == "jobs_abandoned":  # close gave up: only now does the store answer
            store.release.set()

    w.metrics.c.inc = release_at_first_abandon
    w.close(timeout=0.05)  # job 0 finishes its put; jobs 1-3 are abandoned, all reported
    assert w.wait_idle(30)  # job 0's put, released by the first abandon, has finished
    assert w.build_connector_worker_meta().completed_saves == {0: 1, 1: 1, 2: 1, 3: 1}
    assert w.metrics.c.total("jobs_abandoned") == 3


def test_loads_do_not_block_the_step_and_report_when_done() -> None:
    from test_worker_side import TOKENS, load_b

    store = MemoryStore(1 << 26)
    w, runner = _worker(store)
    runner.forward("A", TOKENS, 0, 44, TABLES)
    w.wait_for_save(TailproofMeta(stores=[_job(0)]))
    assert w.wait_idle(10)
    gate = threading.Event()
    orig = store.read_batch

    def slow_read(*a: Any, **k: Any) -> Any:
        assert gate.wait(10)
        return orig(*a, **k)

    store.read_batch = slow_read
    w2, r2 = _worker(store)
    ctab = ([7, 8, 9], [0, 0, 10])
    returns_while_held(lambda: w2.start_load(TailproofMeta(loads=[load_b(ctab)])), gate)
    assert w2.take_transfer_results() == (set(), set())  # not finished: the request waits
    gate.set()
    assert w2.wait_idle(10)
    assert w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 0, 44, ctab) == []
    for x in (w, w2):
        x.close()


def test_sender_copies_release_the_gil() -> None:
    """A 16 MiB block copy on the sender thread leaves the interpreter to the step. With a
    switch interval far longer than the test, the copying thread gives the GIL up only where
    its copy releases it, so this thread runs again exactly in the middle of a copy; a copy
    that held the GIL would let it run only once the copier had ended (``copies`` equal)."""
    from tailproof.impl.kv_layout import KVLayout

    big = torch.zeros(4, 16 << 20, dtype=torch.uint8)
    lay = KVLayout({"m": big}, [["m"]], 4)
    out = np.empty(16 << 20, np.uint8)
    copies = [0, 0]  # copies begun, copies finished
    stop = threading.Event()

    def copy() -> None:
        while not stop.is_set() and copies[1] < 200:  # 200: the copier's own liveness bound
            copies[0] += 1
            lay.read_block(0, 1, out)
            copies[1] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        t = threading.Thread(target=copy)
        t.start()  # returns once the copier has given the GIL up
        begun, finished = copies
        stop.set()
    finally:
        sys.setswitchinterval(interval)
    t.join(60)
    assert not t.is_alive()
    assert begun == finished + 1, copies  # this thread ran in the middle of a copy


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU: the CUDA data path (pinned staging, step event) needs one")
def test_cuda_save_is_ordered_by_the_step_event_not_a_host_wait() -> None:
    """GPU: the CoW copy that fills the block a job reads is still queued behind a long kernel
    when ``wait_for_save`` runs. The step returns at once (no host wait); the sender's
    device-to-host copy waits for the step's event, so the stored value is the copied state."""
    from test_worker_side import HASHES, TOKENS, load_b, save

    store = MemoryStore(1 << 26)
    w, runner = _worker(store, device="cuda")
    runner.forward("A", TOKENS, 0, 44, TABLES)
    torch.cuda.synchronize()
    # ~5 s of GPU time ahead of the CoW copy: a margin only (wait_for_save must return while
    # it runs, in milliseconds), ten times the ~0.5 s it was, so a loaded host never races it.
    torch.cuda._sleep(10_000_000_000)
    runner.copy_blocks([(6, 12)])  # device-side: lands in block 12 only after the sleep
    w.wait_for_save(TailproofMeta(stores=[save(
        0, "A", 32, TABLES, HASHES, [BoundaryPut(0, 3, 44), BoundaryPut(1, 12, 44)])]))
    # Returned while the kernel ahead of the CoW copy still runs: no host wait on the step.
    assert torch.cuda.current_stream().query() is False
    assert w.wait_idle(30)
    w2, r2 = _worker(store, device="cuda")
    ctab = ([7, 8, 9], [0, 0, 10])
    w2.start_load(TailproofMeta(loads=[load_b(ctab)]))
    assert w2.wait_idle(30) and w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 0, 44, ctab) == []
    for x in (w, w2):
        x.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs per-thread priorities (Linux)")
def test_lane_threads_run_below_the_step_priority() -> None:
    prios: list[int] = []
    lanes: Lanes[int] = Lanes(
        "t", lambda j: prios.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
        lambda j: None)
    lanes.submit("k", 1)
    assert lanes.wait_idle(10)
    assert prios == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)]
    lanes.close()
