"""``pause_scheduler(clear_cache=True)`` while store jobs hold pins (issue 20, item 10), under
vLLM 0.33's real Scheduler. A paused scheduler runs no step, so no worker report releases the
pins and ``Scheduler.reset_prefix_cache(reset_running_requests=True)`` raises; the connector's
``drain_for_reset`` (wired before ``EngineCore._reset_caches`` by the vLLM plugin) finishes the
jobs and takes their reports first, so the reset succeeds with nothing dropped early."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

from tailproof.impl.vllm_plugin import patch_engine_core_class  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))


@pytest.fixture
def store_ns(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Connector settings with a key namespace private to this test."""
    return {"store": "memory", "namespace": f"t-{request.node.name}"[:60].replace("@", "_"),
            "capacity_bytes": 1 << 26}


class _Core:
    """The part of ``EngineCore`` the pause path uses: vLLM 0.33's ``_reset_caches`` raises
    when ``reset_prefix_cache(reset_running_requests=True, reset_connector=True)`` fails."""

    def __init__(self, engine: Engine, rpc: Any) -> None:
        self.scheduler = engine.sched
        self.model_executor = SimpleNamespace(collective_rpc=rpc)

    def _reset_caches(self, reset_running_requests: bool = True,
                      reset_connector: bool = True) -> None:
        if not self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests,
                                                 reset_connector=reset_connector):
            raise RuntimeError("Failed to reset the KV connector cache.")


def _paused_with_pins(store_ns: dict, monkeypatch: pytest.MonkeyPatch,
                      gate: threading.Event) -> tuple[Engine, Any]:
    """An engine whose only request was aborted (pause mode "abort") after its step queued
    store jobs; the workers never reported them (their puts wait on ``gate``)."""
    from vllm.distributed import kv_transfer
    from vllm.v1.request import RequestStatus

    e = Engine(store_ns, settle=False)
    store = e.workers[0][0].worker_side.store
    for name in ("put_batch", "write_batch"):
        real = getattr(store, name)

        def gated(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            assert gate.wait(60), "the test never opened the store"
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, gated)
    e.add("p", A, max_tokens=4)
    e.step()
    assert e.conn.scheduler_side.held  # the step's store jobs pin its blocks
    e.sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    worker = e.workers[0][0]
    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: worker)

    def rpc(func: Any, args: tuple = ()) -> list[Any]:  # UniProcExecutor.collective_rpc
        return [func(None, *args)]

    return e, rpc


def test_reset_of_a_paused_engine_fails_on_pins_without_the_drain(
        store_ns: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why it raised: the pins keep blocks in use, so vLLM's reset fails and raises."""
    gate = threading.Event()
    e, rpc = _paused_with_pins(store_ns, monkeypatch, gate)
    try:
        with pytest.raises(RuntimeError, match="Failed to reset KV cache even when all the "
                                               "running"):
            _Core(e, rpc)._reset_caches()
    finally:
        gate.set()
        e.shutdown()


def test_pause_clear_cache_drains_store_jobs_then_resets(
        store_ns: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    e, rpc = _paused_with_pins(store_ns, monkeypatch, gate)

    class Core(_Core):
        pass

    patch_engine_core_class(Core)
    patch_engine_core_class(Core)  # idempotent
    epoch = e.conn.epoch
    assert e.conn.scheduler_side.held  # still held: the puts wait on the gate
    gate.set()  # the store answers again; the drain waits for the jobs to finish
    Core(e, rpc)._reset_caches()  # no raise
    assert e.conn.scheduler_side.held == {}
    assert e.refcounts() == {}
    assert e.conn.epoch != epoch  # the connector's own reset ran too
    assert not e.conn.has_pending_push_work()
    e.shutdown()


def test_plugin_patches_the_real_engine_core() -> None:
    from vllm.v1.engine.core import EngineCore

    from tailproof.impl.vllm_plugin import register

    register()
    assert getattr(EngineCore, "_tailproof_reset_drain", False)
