"""CallGuard: no calls after close, fail fast while tripped, recovery through the probe."""

from __future__ import annotations

import threading

from storetest_helpers import wait_until

from tailproof.impl.stores.guard import CLOSED, CallGuard


class Backend:
    def __init__(self) -> None:
        self.health: str | None = None
        self.up = True
        self.probes = 0
        self.probed = threading.Condition()  # notified after every probe

    def probe(self) -> bool:
        with self.probed:
            self.probes += 1
            self.probed.notify_all()
        return self.up

    def wait_probes(self, n: int) -> bool:
        """Wait until ``n`` probes have run (the guard's prober thread calls ``probe``)."""
        with self.probed:
            return self.probed.wait_for(lambda: self.probes >= n, 30)


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
    assert b.wait_probes(b.probes + 2)  # the prober went round again after a failed probe
    with g.call() as down:
        assert down == "master unreachable"
    b.up = True
    assert wait_until(lambda: g.down_reason is None, 30.0)
    with g.call() as down:
        assert down is None
    g.close()


def test_trip_then_recover_then_trip_again() -> None:
    b = Backend()
    g = CallGuard(lambda: b.health, b.probe, probe_interval_s=0.01)
    for _ in range(3):
        g.trip("rpc failed")
        assert g.down_reason == "rpc failed"
        assert wait_until(lambda: g.down_reason is None, 30.0)
    g.close()


def test_close_waits_for_in_flight_and_refuses_new_calls() -> None:
    b = Backend()
    g = CallGuard(lambda: b.health, b.probe)
    entered, release, closed = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []
    close_waits = threading.Event()

    class SeenWaiting(threading.Condition):
        """The guard's condition, telling the test when ``close`` starts waiting on it."""

        def wait(self, timeout: float | None = None) -> bool:
            close_waits.set()
            return super().wait(timeout)

    g._cond = SeenWaiting()  # before any call, and no prober runs here: safe to swap

    def slow_call() -> None:
        with g.call() as down:
            assert down is None
            entered.set()
            assert release.wait(30)
            order.append("call ends")

    t = threading.Thread(target=slow_call)
    t.start()
    assert entered.wait(30)
    closer = threading.Thread(target=lambda: (g.close(), order.append("close returns"),
                                              closed.set()))
    closer.start()
    assert close_waits.wait(30)  # close is blocked on the in-flight call ...
    assert g.closed and not closed.is_set()  # ... having refused new calls already
    release.set()  # only now may the in-flight call end
    t.join(30)
    closer.join(30)
    assert order == ["call ends", "close returns"]  # close waited for the in-flight call
    assert closed.is_set() and g.closed
    with g.call() as down:
        assert down == CLOSED
    assert g.close() is False  # idempotent
    g.trip("after close")  # no prober is started on a closed guard
    assert g.down_reason is None
