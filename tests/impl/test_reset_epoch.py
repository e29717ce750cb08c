"""A prefix-cache reset moves the key epoch only when it succeeds, and a job carries the epoch
its KV was computed in -- under vLLM 0.33's real ``Scheduler`` (``engine_sim``).

vLLM's ``Scheduler.reset_prefix_cache(reset_connector=True)`` calls the connector's
``reset_cache`` even when its own block-pool reset failed; a finish-time job is emitted with a
later step's metadata than the one its KV was taken in.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

from tailproof.impl.keys import INITIAL_EPOCH, parse_key  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))  # 45 tokens: a sub-block tail, so max_tokens=1 leaves a finish-time job


def _engine(name: str) -> Engine:
    return Engine({"store": "memory", "namespace": f"reset-{name}", "capacity_bytes": 1 << 26})


def _epochs(e: Engine) -> set[str]:
    """The epochs of every key the engine's worker stored."""
    store = e.workers[0][0].worker_side.store
    mine = f"kv2:{e.conn.settings.namespace}@"
    return {parse_key(k).epoch for k in store._data if k.startswith(mine)}


def test_a_reset_refused_for_blocks_in_use_keeps_the_epoch() -> None:
    e = _engine("refused")
    try:
        e.add("t1", A, max_tokens=4)
        e.step()  # t1 runs: its blocks hold KV computed before any reset
        assert e.sched.reset_prefix_cache(reset_connector=True) is False
        assert e.conn.epoch == INITIAL_EPOCH  # the failed reset moved nothing
        e.run()
        assert e.conn.scheduler_side.held == {}
        assert _epochs(e) == {INITIAL_EPOCH}
        assert e.sched.reset_prefix_cache(reset_connector=True) is True  # idle: it succeeds
        assert e.conn.epoch != INITIAL_EPOCH
        e.add("again", [*A, 4, 5], max_tokens=1)
        assert [j.kvpool_cached_tokens for log in e.run() for j in log.loads] == []
    finally:
        e.shutdown()


def test_a_pending_finish_time_job_refuses_the_reset_and_keeps_its_epoch() -> None:
    from vllm.v1.request import RequestStatus

    e = _engine("pending")
    try:
        e.add("t1", A, max_tokens=4)
        assert e.step().scheduled == {"t1": 32}
        assert e.step().scheduled == {"t1": 12}  # computed = ck(45) = 44
        # Aborted there, t1 hands its tail off at finish (``register_finished_partial_tail``):
        # the job is pinned now and emitted with the next step's metadata.
        e.sched.finish_requests("t1", RequestStatus.FINISHED_ABORTED)
        side = e.conn.scheduler_side
        (job,) = side.finished_partial_tails.values()
        assert job.epoch == INITIAL_EPOCH
        assert e.conn.reset_cache() is False  # its pins: KV from before the reset
        assert e.conn.epoch == INITIAL_EPOCH
        # Were the epoch moved anyway (a reset that bypassed the refusal), the job keeps the
        # epoch its KV was computed in, and jobs built afterwards take the new one.
        side.move_epoch("0badcafe")
        e.add("t2", [7, *A[1:]], max_tokens=1)
        logs = e.run()
        stores = [s for log in logs for s in log.stores]
        assert job in stores and job.epoch == INITIAL_EPOCH
        assert {s.epoch for s in stores if s is not job} == {"0badcafe"}
        assert _epochs(e) == {INITIAL_EPOCH, "0badcafe"}
    finally:
        e.shutdown()
