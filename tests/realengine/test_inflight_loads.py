"""Asynchronous store loads in flight, in vLLM's real engine (test bed, core in the bed process,
``uni`` executor, memory store): under vLLM 0.34's ``--max-num-inflight-kv-loads 1``, and with
requests aborted while their loads run (both releases), nothing gets stuck and nothing leaks.

vLLM's side of the contract (``Scheduler.finish_requests``, ``_update_from_kv_xfer_finished``,
``v1/core/sched/scheduler.py``, both releases): a request aborted in ``WAITING_FOR_REMOTE_KVS``
keeps its blocks until the connector reports its load in ``finished_recving``; on 0.34 it also
keeps its load slot (``_aborted_kv_loads``, counted by ``_admits_inflight_kv_load``), so under
the cap a load the connector never reports would stall every later load. The connector's side:
every load it started is reported exactly once, however its request ended, and every piece of
per-request state, pin and store handle is dropped once the engine is idle
(``bed.scheduler_leftovers`` / ``bed.worker_leftovers``: all zero).

Deterministic without sleeping: the worker's store reads wait at a gate
(``bed.hold_store_reads``) and the test waits on the gate's condition until the load is inside
its read; requests are aborted right after the step that started the loads. The oracle is the
session's ground truth (``conftest.truth``, prefix caching off).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine.oracle import MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

SUBSET = (5, 8, 9, 11)  # shared-prefix prompts of 150+, 288+, 320+ and 515+ tokens
ABORTED = 2  # the first two requests are aborted once the loads started
HELD_STEPS = 3  # engine steps run while the aborted loads stay inside their reads
MAX_STEPS = 20_000  # far more than any run here takes; reaching it means something is stuck


@pytest.fixture(scope="module")
def capped() -> bool:
    from tailproof.conformance.realengine.release import inflight_kv_load_cap

    return inflight_kv_load_cap()


@pytest.fixture(scope="module")
def case(prompts: list[list[int]], truth: list[tuple[int, ...]]
         ) -> tuple[list[list[int]], list[list[int]]]:
    return [prompts[i] for i in SUBSET], [list(truth[i]) for i in SUBSET]


@pytest.fixture(scope="module")
def bed(capped: bool, case: tuple[Any, Any]) -> Iterator[tb.Bed]:
    """Two running slots (``max_num_seqs``), so loads also start while the batch is full; on
    0.34 at most one asynchronous load in flight. The prompts are stored once (a cold pass)."""
    extra = {"max_num_inflight_kv_loads": 1} if capped else {}
    spec = tb.EngineSpec(kv_transfer_config=tb.memory_connector("rt-inflight"), max_num_seqs=2,
                         engine_args=extra)
    prompts, want = case
    with tb.Bed(spec) as b:
        assert [list(c.tokens) for c in b.generate(prompts, MAX_TOKENS)] == want  # cold: stores
        yield b


# --- run in the bed process (Bed.call) ------------------------------------------------------


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _greedy() -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def _gets(llm: Any) -> int:
    return sum(c.get("get_keys", 0) for c in llm.collective_rpc(tb.connector_counters))


def _loads_in_flight(sched: Any) -> int:
    """vLLM 0.34's count against ``--max-num-inflight-kv-loads`` (``_admits_inflight_kv_load``):
    loads in progress, loads done and waiting for a running slot, aborted loads not reported."""
    return _loads_started(sched) + len(sched._aborted_kv_loads)


def _loads_started(sched: Any) -> int:
    """Live requests whose load started: in progress, or done and waiting for a running slot
    (``Scheduler._kv_fetch_counts``, both releases)."""
    from vllm.v1.metrics.stats import KV_FETCH_COMPLETED_WAITING, KV_FETCH_IN_PROGRESS

    counts = sched._kv_fetch_counts
    return counts[KV_FETCH_IN_PROGRESS] + counts[KV_FETCH_COMPLETED_WAITING]


def _step(llm: Any, done: dict[str, list[int]]) -> None:
    for out in llm.llm_engine.step():
        if out.finished:
            done[out.request_id] = list(out.outputs[0].token_ids)


def _busy(llm: Any) -> bool:
    """Whether the engine still has work: a request, or (``Scheduler.has_requests``) a finished
    request's delayed free or a store job the connector waits on."""
    return llm.llm_engine.has_unfinished_requests() or _scheduler(llm).has_requests()


def _run_to_idle(llm: Any, done: dict[str, list[int]], per_step: Any = None) -> int:
    """Step until the engine is idle; once no request is left to run, first let the workers
    finish their jobs (waiting on them, not spinning). Steps taken."""
    sched = _scheduler(llm)
    for n in range(MAX_STEPS):
        if not _busy(llm):
            return n
        if not sched.running and not sched.waiting:
            assert all(llm.collective_rpc(tb.wait_connector_idle, args=(120.0,)))
        _step(llm, done)
        if per_step is not None:
            per_step()
    raise AssertionError(f"stuck: engine still busy after {MAX_STEPS} steps: "
                         f"{tb.scheduler_leftovers(llm)}")


def _store_hits_from_cold_device(llm: Any) -> None:
    assert tb.drain_store_jobs(llm, 120.0)
    assert llm.reset_prefix_cache()  # device only: every hit now comes from the store


def leftovers(llm: Any) -> dict[str, dict[str, int]]:
    """Every leftover counter that is not 0 (``bed.scheduler_leftovers``, per worker
    ``bed.worker_leftovers``), once the engine is idle."""
    _run_to_idle(llm, {})
    out = {"scheduler": {k: v for k, v in tb.scheduler_leftovers(llm).items() if v}}
    for rank, w in enumerate(llm.collective_rpc(tb.worker_leftovers)):
        out[f"worker{rank}"] = {k: v for k, v in w.items() if v}
    return {k: v for k, v in out.items() if v}


def capped_store_hits(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Every prompt at once with its prefix in the store and an empty device cache, run to
    idle; what vLLM's load cap saw on the way."""
    sched, eng = _scheduler(llm), llm.llm_engine
    _store_hits_from_cold_device(llm)
    gets = _gets(llm)
    for i, p in enumerate(prompts):
        eng.add_request(f"cap{i}", {"prompt_token_ids": p}, _greedy())
    seen = {"parked": len(sched.async_kv_waiting), "in_flight": 0}

    def watch() -> None:
        seen["parked"] = max(seen["parked"], len(sched.async_kv_waiting))
        seen["in_flight"] = max(seen["in_flight"], _loads_in_flight(sched))

    done: dict[str, list[int]] = {}
    steps = _run_to_idle(llm, done, watch)
    return {"outputs": [done.get(f"cap{i}") for i in range(len(prompts))], "steps": steps,
            "gets": _gets(llm) - gets, **seen}


def abort_in_flight_loads(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Store reads held at the worker's gate; every prompt submitted (prefixes in the store,
    device cache empty); one step starts the loads vLLM admits and the first enters its read.
    The first :data:`ABORTED` requests are aborted, :data:`HELD_STEPS` steps run with the reads
    still held, then the gate opens and the engine runs to idle."""
    sched, eng = _scheduler(llm), llm.llm_engine
    _store_hits_from_cold_device(llm)
    ids = [f"ab{i}" for i in range(len(prompts))]
    done: dict[str, list[int]] = {}
    assert all(llm.collective_rpc(tb.hold_store_reads))
    try:
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(rid, {"prompt_token_ids": p}, _greedy())
        _step(llm, done)  # admits the loads it can start; the worker queues them
        in_read = llm.collective_rpc(tb.reads_held, args=(1,))
        loading = sum(1 for r in sched.requests.values()
                      if r.status.name == "WAITING_FOR_REMOTE_KVS")
        eng.abort_request(ids[:ABORTED])
        for _ in range(HELD_STEPS):
            _step(llm, done)
        held = {**tb.scheduler_leftovers(llm), "loads_started": _loads_started(sched)}
        held_workers = llm.collective_rpc(tb.worker_leftovers)
    finally:
        passed = llm.collective_rpc(tb.release_store_reads)
    steps = _run_to_idle(llm, done)
    return {"in_read": in_read, "loading": loading, "held": held, "held_workers": held_workers,
            "reads": passed, "steps": steps, "outputs": [done.get(r) for r in ids[ABORTED:]]}


# --- the tests ------------------------------------------------------------------------------


def test_capped_loads_all_finish_equal_the_truth_and_leave_nothing(
        bed: tb.Bed, capped: bool, case: tuple[Any, Any]) -> None:
    """``--max-num-inflight-kv-loads 1`` with every request hitting the store: the connector
    answers ``may_load_async`` (requests park in vLLM's ``async_kv_waiting``), loads run one
    at a time, every request finishes with the truth's tokens, nothing is left held."""
    if not capped:
        pytest.skip("needs vLLM 0.34's --max-num-inflight-kv-loads "
                    "(SchedulerConfig.max_num_inflight_kv_loads); this vLLM has no load cap")
    prompts, want = case
    r = bed.call(capped_store_hits, prompts)
    assert r["outputs"] == want
    assert r["gets"] > 0  # served from the store
    assert r["parked"] >= len(prompts) - 1  # may_load_async: all but the first wait for a slot
    assert r["in_flight"] == 1  # the cap held, and loads did run
    assert bed.call(leftovers) == {}


def test_aborted_in_flight_loads_leave_nothing_and_later_requests_serve(
        bed: tb.Bed, capped: bool, case: tuple[Any, Any]) -> None:
    """Requests aborted while their loads are inside the store read: vLLM keeps their blocks
    (and on 0.34 the load slot) until the connector reports the loads; once the reads go on,
    every held block, slot, pin and staging buffer comes back, the other requests finish with
    the truth's tokens, and the next pass is served from the store, equal to the truth."""
    prompts, want = case
    r = bed.call(abort_in_flight_loads, prompts)
    assert r["in_read"] == [1]  # one load inside its read (the receiver runs one at a time)
    # 0.34's cap admits one load; 0.33 starts every admitted load (the rest queue behind it)
    assert r["loading"] == (1 if capped else len(prompts))
    held = r["held"]
    assert held["vllm_blocks_in_use"] > 0  # the aborted loads' blocks wait for their reports
    if capped:  # the aborted load keeps the only slot: nothing else starts meanwhile
        assert held["vllm_aborted_kv_loads"] == 1 and held["loads_started"] == 0
    assert r["held_workers"][0]["staging_in_use"] == 1  # the held read's buffer
    assert r["outputs"] == want[ABORTED:]
    assert bed.call(leftovers) == {}
    assert bed.reset_prefix_cache()
    got = bed.generate(prompts, MAX_TOKENS)
    assert [list(c.tokens) for c in got] == want
    assert all(c.num_cached_tokens > 0 for c in got)
    assert bed.call(leftovers) == {}
