"""CallGuard: no calls after close, fail fast while tripped, recovery through the probe."""

from __future__ import annotations

import threading
import time

from storetest_helpers import wait_until

from tailproof.impl.stores.guard import CLOSED, CallGuard


class Backend:
    def __init__(self) -> None:
        self.health: str | None = None
        self.up = True
        self.probes = 0

    def probe(self) -> bool:
        self.probes += 1
        return self.up


def test_healthy_calls_pass_and_unhealthy_trip() -> None:
    b = Backend()
    g = CallGuard(lambda: b.health, b.probe, probe_interval_s=0.01)
    with g.call() as down:
        assert down is None
    b.health, b.up = "master unreachable", False
    with g.call() as down:
        assert down == "master unreachable"
    assert g.down_reason == "master unreachable"
    b.health = None  # health looks fine, but the probe still fails: stay down
    time.sleep(0.05)
    with g.call() as down:
        assert down == "master unreachable"
    b.up = True
    assert wait_until(lambda: g.down_reason is None, 2.0)
    with g.call() as down:
        assert down is None
    g.close()


def test_trip_then_recover_then_trip_again() -> None:
    b = Backend()
    g = CallGuard(lambda: b.health, b.probe, probe_interval_s=0.01)
    for _ in range(3):
        g.trip("rpc failed")
        assert g.down_reason == "rpc failed"
        assert wait_until(lambda: g.down_reason is None, 2.0)
    g.close()


def test_close_waits_for_in_flight_and_refuses_new_calls() -> None:
    b = Backend()
    g = CallGuard(lambda: b.health, b.probe)
    entered, release, closed = threading.Event(), threading.Event(), threading.Event()

    def slow_call() -> None:
        with g.call() as down:
            assert down is None
            entered.set()
            release.wait(5)

    t = threading.Thread(target=slow_call)
    t.start()
    entered.wait(5)
    closer = threading.Thread(target=lambda: (g.close(), closed.set()))
    closer.start()
    time.sleep(0.05)
    assert not closed.is_set()  # close waits for the in-flight call
    release.set()
    t.join(5)
    closer.join(5)
    assert closed.is_set() and g.closed
    with g.call() as down:
        assert down == CLOSED
    assert g.close() is False  # idempotent
    g.trip("after close")  # no prober is started on a closed guard
    assert g.down_reason is None
