"""The copy crew: every index exactly once, no call running after for_each returns, errors."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from tailproof.impl.stores.copies import MIN_PARALLEL_BYTES, CopyCrew


def shared(fn: Callable[[int], None]) -> Callable[[int], None]:
    """``fn`` made to need a helper: a call on the calling thread (the one that wraps it, then
    calls ``for_each``) waits until a helper has entered a call, so the batch is split between
    at least two threads however the threads are scheduled (no sleep)."""
    caller, helper_in = threading.get_ident(), threading.Event()

    def call(i: int) -> None:
        if threading.get_ident() == caller:
            assert helper_in.wait(30), "no helper took an index"
        else:
            helper_in.set()
        fn(i)
    return call


def test_every_index_runs_once_and_helpers_share_the_work() -> None:
    crew = CopyCrew(2)
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def fn(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name))

    crew.for_each(20, shared(fn))
    assert sorted(i for i, _ in seen) == list(range(20))
    assert len({name for _, name in seen}) == 2
    crew.close()


def test_nothing_runs_after_for_each_returns() -> None:
    crew = CopyCrew(3)
    running = [0]
    lock = threading.Lock()

    for _ in range(50):
        last_started = threading.Event()

        def fn(i: int, last_started: threading.Event = last_started) -> None:
            with lock:
                running[0] += 1
            if i == 6:
                last_started.set()
            elif i == 0:  # still running when the last index is handed out
                assert last_started.wait(30)
            with lock:
                running[0] -= 1

        crew.for_each(7, fn)
        assert running[0] == 0
    crew.close()


def test_the_first_error_is_raised_and_stops_handing_out_indices() -> None:
    crew = CopyCrew(2)
    ran: list[int] = []

    raised = threading.Event()

    def fn(i: int) -> None:
        ran.append(i)
        if i == 1:
            raised.set()
            raise OSError("disk on fire")
        assert raised.wait(30)  # every other call is in flight until the error

    with pytest.raises(OSError, match="disk on fire"):
        crew.for_each(50, fn)
    assert len(ran) < 50
    crew.close()


def test_small_batches_and_a_closed_crew_run_on_the_caller() -> None:
    crew = CopyCrew(2)
    names: set[str] = set()
    crew.for_each(4, lambda i: names.add(threading.current_thread().name),
                  nbytes=MIN_PARALLEL_BYTES - 1)
    assert names == {threading.current_thread().name}
    crew.close()
    crew.close()  # idempotent
    crew.for_each(4, lambda i: names.add(threading.current_thread().name))
    assert names == {threading.current_thread().name}


def test_parallel_copies_move_the_right_bytes() -> None:
    crew = CopyCrew(2)
    src = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(9)]
    dst = [np.empty_like(s) for s in src]
    crew.for_each(9, lambda i: np.copyto(dst[i], src[i]), nbytes=9 << 20)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    crew.close()


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="copy threads"):
        CopyCrew(0)


def test_helpers_run_at_their_callers_priority() -> None:
    import os

    if not hasattr(os, "setpriority"):
        pytest.skip("os.setpriority is missing on this platform")
    crew = CopyCrew(2)
    seen: dict[str, set[int]] = {"low": set(), "normal": set()}

    def record(kind: str) -> None:
        def fn(i: int) -> None:
            seen[kind].add(os.getpriority(os.PRIO_PROCESS, 0))
        crew.for_each(8, shared(fn))  # a helper copies too

    def low() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        record("low")

    base = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=low)
    t.start()
    t.join()
    record("normal")
    crew.close()
    assert seen["low"] == {base + 5}  # the helper inherited the low caller's priority
    assert seen["normal"] == {base}
