"""Store faults on a REAL ``mooncake_master`` under the asynchronous data plane.

The same harness as ``test_async_stress`` (vLLM's real Scheduler, two workers, per-step
invariants, byte checks on every load, no leak at the end) against a master that is full,
killed, or frozen mid-put. Store calls then block (a frozen master until the RPC timeout, a
killed one ~4.5 s for the first call) -- on the sender/receiver threads only: no data-plane
store call is made on the step's thread, steps complete while a data-plane call is held, and
every request still finishes with its KV correct (failed I/O fails closed). No clock: how fast
those steps are is measured in ``benchmarks/test_async_fault_steps.py``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402
from test_async_stress import Invariants, _prompts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

MIB = 1 << 20
LIVENESS_S = 60.0  # a held store call gives up after this (only fails the test, never paces)
DATA_PLANE = ("exists", "put_batch", "write_batch", "get_batch", "read_batch")


class StoreProbe:
    """Watches the data plane's store calls (every worker's store) once armed: any call on
    the engine's step thread is recorded (the step would wait for the store), and the first
    call on a sender/receiver thread is held until the engine has completed two more steps
    (a step that waited for that call, or for a lock its thread holds, never completes)."""

    def __init__(self, e: Engine) -> None:
        self.step_thread = threading.get_ident()
        self.armed = False
        self.on_step_thread: list[str] = []
        self.held = threading.Event()  # the held call has begun waiting
        self.released = threading.Event()  # two whole steps ran since: let it through
        self.gave_up = False  # the held call waited LIVENESS_S in vain
        self._lock = threading.Lock()
        self._steps_at_hold: int | None = None
        stores = {id(wc.worker_side.store): wc.worker_side.store for wc, _ in e.workers}
        for store in stores.values():
            for name in DATA_PLANE:
                self._wrap(store, name)

    def _wrap(self, store: Any, name: str) -> None:
        real = getattr(store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                if threading.get_ident() == self.step_thread:
                    self.on_step_thread.append(name)
                elif self._take_hold():
                    self.gave_up = not self.released.wait(LIVENESS_S)
            return real(*args, **kwargs)

        setattr(store, name, call)

    def _take_hold(self) -> bool:
        with self._lock:
            if self.held.is_set():
                return False
            self.held.set()
            return True

    def step_done(self, steps: int) -> None:
        """The engine completed its ``steps``-th step: release the held call after two more
        (the first of them began after the hold did)."""
        if not self.held.is_set() or self.released.is_set():
            return
        if self._steps_at_hold is None:
            self._steps_at_hold = steps
        elif steps - self._steps_at_hold >= 2:
            self.released.set()


def _cfg(address: str, tag: str) -> dict[str, Any]:
    return {"store": "mooncake", "master_address": address, "namespace": f"mcf-{tag}",
            "global_segment_size": 16 * MIB, "local_buffer_size": 16 * MIB,
            "rpc_timeout_ms": 1500, "setup_retries": 1, "send_threads": 2, "recv_threads": 2}


def _serve(e: Engine, prompts: list[list[int]], fault_at: int | None = None,
           fault: Callable[[], None] | None = None) -> tuple[list[Any], list[float]]:
    """Add every request at once, run ``fault`` before the first step at or after ``fault_at``
    with no request left waiting (store lookups are synchronous scheduler work, as in vLLM's
    Mooncake connector, so the fault hits the data plane only), serve to the end with the
    per-step invariants, then check the probe: no data-plane store call on the step's thread,
    and whole steps completed while one was held. Returns the requests and the step times
    from the fault on (for the benchmark; nothing here reads a clock's value)."""
    inv = Invariants(e)
    probe = StoreProbe(e)
    reqs = [e.add(f"r{i}", p, max_tokens=8) for i, p in enumerate(prompts)]
    steps, after, fired = 0, [], None
    while e.sched.has_requests() or e.conn.has_pending_push_work():
        if (fired is None and fault_at is not None and fault is not None and steps >= fault_at
                and not e.sched.waiting):
            fault()
            probe.armed = True
            fired = steps
        before = set(e.conn.scheduler_side.held)
        t = time.perf_counter()
        log = e.step()
        if fired is not None and log.scheduled:
            after.append(time.perf_counter() - t)
        inv.after_step(before)
        probe.step_done(steps + 1)
        if not log.scheduled:
            e.wait_workers(0.02)
        steps += 1
        assert steps < 5000, "engine did not drain"
    assert e.wait_workers(30.0)
    assert [x for log in e.log for x in log.byte_errors] == []
    assert e.conn.scheduler_side.held == {} and e.refcounts() == {}
    for wc, _ in e.workers:
        assert wc.worker_side.queue == [] and wc.worker_side.stored_requests == {}
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert fault is None or fired is not None, "the fault never fired"
    probe.armed = False
    assert probe.on_step_thread == [], "a step called the store itself"
    if fault is not None:
        assert probe.held.is_set(), "no data-plane store call after the fault"
        assert probe.released.is_set() and not probe.gave_up, "steps waited for the store"
    return reqs, after


def _engine(address: str, tag: str) -> Engine:
    return Engine(_cfg(address, tag), num_blocks=96, num_workers=2, settle=False)


def _total(e: Engine, name: str) -> int:
    return sum(wc.worker_side.metrics.c.total(name) for wc, _ in e.workers)


def test_frozen_master_mid_put_never_stalls_a_step(mooncake_master_factory: Any) -> None:
    """SIGSTOP the master while the first step's store jobs are in flight, SIGCONT 3 s later:
    steps go on while the data plane blocks, the jobs time out or finish, every pin is
    released."""
    master = mooncake_master_factory()
    e = _engine(master.address, "frozen")
    thaw = threading.Timer(3.0, lambda: master.signal(signal.SIGCONT))
    try:
        def freeze() -> None:
            master.signal(signal.SIGSTOP)
            thaw.start()

        _serve(e, _prompts(6), fault_at=1, fault=freeze)
        assert _total(e, "put_fail_timeout") + _total(e, "put_fail_error") >= 1
    finally:
        thaw.cancel()
        master.signal(signal.SIGCONT)
        e.shutdown()


def test_killed_master_fails_closed_without_stalling(mooncake_master_factory: Any) -> None:
    """Engine 1 stores, engine 2 finds the prefixes and loads; the master is killed right after
    engine 2 queued its loads. Loads and saves then fail closed on the threads; no step stalls,
    every request finishes with correct KV, nothing leaks."""
    master = mooncake_master_factory()
    prompts = _prompts(6)
    e1 = _engine(master.address, "killed")
    _serve(e1, prompts)
    e2 = _engine(master.address, "killed")
    try:
        _serve(e2, [p + [5] * 9 for p in prompts], fault_at=1, fault=master.kill)
        assert _total(e2, "get_batches") + _total(e2, "loads_rejected_queue_full") >= 1
    finally:
        e2.shutdown()
        e1.shutdown()


def test_full_store_skips_saves_and_keeps_serving(mooncake_master_factory: Any) -> None:
    """The engine's 16 MiB segment is filled by another client first (eviction off): puts
    answer STORE_FULL, the pressure gate skips, serving goes on, every pin is released."""
    master = mooncake_master_factory("--eviction_high_watermark_ratio=1.0",
                                     "--eviction_ratio=0.0")
    from tailproof.impl.stores import Status, make_store

    filler = make_store({"backend": "mooncake", "master_address": master.address,
                         "global_segment_size": 0, "rpc_timeout_ms": 1500})
    e = _engine(master.address, "full")
    try:
        v = np.zeros(MIB, np.uint8)
        outs = filler.put_batch([f"fill{i}" for i in range(40)], [v] * 40)
        assert Status.STORE_FULL in {o.status for o in outs}
        _serve(e, _prompts(6))
        assert _total(e, "put_fail_store_full") >= 1
    finally:
        e.shutdown()
        filler.close()
