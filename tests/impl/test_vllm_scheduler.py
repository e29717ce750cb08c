"""TailproofConnector under vLLM 0.33's real Scheduler on CPU (tiny hybrid model, no weights).

Calling order is vLLM's own; the model runner is played by ``engine_sim``; every load is checked
byte for byte against the KV its token prefix must have. Scenarios: a multi-turn conversation
served across engines through the store (whole blocks + the sub-block Mamba tail), the
finish-time hand-off (``max_tokens=1``), store failures (fail closed), two workers, preemption,
pins released exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

from tailproof.impl.connector import TailproofConnector  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))  # 45 tokens: ck(45) = 44 with h=4, a sub-block tail in block 2 (16)


def _no_byte_errors(e: Engine) -> None:
    errs = [x for log in e.log for x in log.byte_errors]
    assert errs == []


def _drained(e: Engine) -> None:
    """Everything finished: no pins left, no block referenced, a prefix reset succeeds."""
    assert e.conn.scheduler_side.held == {}
    assert e.refcounts() == {}
    assert e.sched.kv_cache_manager.reset_prefix_cache()


@pytest.fixture
def store_ns(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Connector settings with a key namespace private to this test; scripted store faults
    left over in the (process-shared) memory store are cleared afterwards."""
    yield {"store": "memory", "namespace": f"t-{request.node.name}"[:60].replace("@", "_"),
           "capacity_bytes": 1 << 26}
    from tailproof.impl import connector

    for store, _ in list(connector._SHARED.values()):
        faults = getattr(store, "faults", None)
        if faults is not None:
            faults.clear()


def test_connector_is_loaded_from_kv_transfer_config(store_ns: dict) -> None:
    e = Engine(store_ns)
    assert isinstance(e.conn, TailproofConnector)
    assert e.conn.geo.partial_hits and e.conn.geo.alignment == 4
    assert e.conn.geo.scheduler_block_size == 16 and e.conn.geo.is_mamba == (False, True)
    e.shutdown()


def test_multi_turn_conversation_across_engines(store_ns: dict) -> None:
    """Turn 1 on engine 1 publishes blocks + the 44-token sub-block tail; turn 2 (prompt =
    turn 1 + answer + new text) on a fresh engine 2 loads them from the store."""
    e1 = Engine(store_ns)
    e1.add("t1", A, max_tokens=3)
    logs = e1.run()
    assert [log.scheduled.get("t1") for log in logs[:3]] == [32, 12, 1]  # split at ck(45)=44
    puts = [p for log in logs for s in log.stores for p in s.boundary_puts]
    assert (1, 44) in {(p.group_id, p.num_tokens) for p in puts}  # Mamba tail@44 (CoW target)
    assert (0, 44) in {(p.group_id, p.num_tokens) for p in puts}  # FA tail block keyed at 44
    t1 = e1.log[-1]
    assert t1 is not None
    _drained(e1)
    # Turn 2: exactly turn 1's prompt resent -> hit at 44 (the sub-block tail), not 32.
    e2 = Engine(store_ns)
    e2.add("t2", list(A), max_tokens=1)
    logs2 = e2.run()
    loads = [j for log in logs2 for j in log.loads]
    assert [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for j in loads] == [(0, 44)]
    _no_byte_errors(e2)
    stats = e2.conn.scheduler_side.metrics
    assert stats is not None
    _drained(e2)
    # Turn 3: a longer conversation: prompt extends turn 2's; hit covers its blocks.
    e3 = Engine(store_ns)
    e3.add("t3", list(A) + [7] * 30, max_tokens=2)
    logs3 = e3.run()
    loads3 = [j for log in logs3 for j in log.loads]
    assert len(loads3) == 1 and loads3[0].kvpool_cached_tokens >= 44
    _no_byte_errors(e3)
    _drained(e3)
    for e in (e1, e2, e3):
        e.shutdown()


def test_max_tokens_one_producer_hands_off_tail(store_ns: dict) -> None:
    """A max_tokens=1 producer still publishes its sub-block tail (CoW path, E1)."""
    e1 = Engine(store_ns)
    e1.add("p", A, max_tokens=1)
    e1.run()
    _drained(e1)
    e2 = Engine(store_ns)
    e2.add("c", A + [5, 6, 7], max_tokens=1)
    logs = e2.run()
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    _no_byte_errors(e2)
    _drained(e2)


def test_failed_load_is_recomputed_never_served(store_ns: dict) -> None:
    e1 = Engine(store_ns)
    e1.add("p", A, max_tokens=1)
    e1.run()
    e2 = Engine(store_ns)
    store = e2.conn.store
    from tailproof.impl.stores import Outcome

    store.faults.script("get", [Outcome.timeout()] * 100)  # the store keeps failing gets
    req = e2.add("c", list(A), max_tokens=1)
    logs = e2.run()
    # One load, failed; the request is not offered the store again (no retry livelock).
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    # The failed load was not served: the request recomputed its whole prompt.
    assert sum(log.scheduled.get("c", 0) for log in logs) == len(A)
    assert req.num_output_tokens == 1
    assert e2.workers[0][0].worker_side.metrics.c.total("load_failures") == 1
    _drained(e2)


def test_failed_load_with_fail_policy_errors_the_request(store_ns: dict) -> None:
    """Under vLLM's default kv_load_failure_policy='fail' the request ends in error: the
    unloaded KV is still never served."""
    e1 = Engine(store_ns)
    e1.add("p", A, max_tokens=1)
    e1.run()
    e2 = Engine(store_ns, failure_policy="fail")
    from tailproof.impl.stores import Outcome

    e2.conn.store.faults.script("get", [Outcome.miss()])
    req = e2.add("c", list(A), max_tokens=1)
    e2.run()
    assert req.status.name == "FINISHED_ERROR" and req.num_output_tokens == 0
    _drained(e2)


def test_store_full_does_not_break_serving(store_ns: dict) -> None:
    cfg = dict(store_ns, capacity_bytes=4096, evict=False)
    e = Engine(cfg)
    e.add("a", A + [3] * 40, max_tokens=2)
    e.run()
    ws = e.workers[0][0].worker_side
    assert ws.metrics.c.total("put_fail_store_full") >= 1
    _drained(e)


def test_two_workers_pins_released_after_both_report(store_ns: dict) -> None:
    e1 = Engine(store_ns, num_workers=2)
    e1.add("p", A, max_tokens=2)
    e1.run()
    _drained(e1)
    e2 = Engine(store_ns, num_workers=2)
    e2.add("c", list(A), max_tokens=1)
    logs = e2.run()
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    _no_byte_errors(e2)
    _drained(e2)


def test_pins_hold_blocks_until_reported(store_ns: dict) -> None:
    """Between a step's store job and its report every pinned block has ref >= 1."""
    e = Engine(store_ns)
    e.add("p", A, max_tokens=1)
    so = e.sched.schedule()
    jobs = so.kv_connector_metadata.stores
    assert jobs
    side = e.conn.scheduler_side
    for job in jobs:
        ids, left = side.held[job.store_job_id]
        assert left == 1
        assert all(e.sched.kv_cache_manager.block_pool.blocks[b].ref_cnt >= 1 for b in ids)
    e.shutdown()


def test_preemption_and_resume(store_ns: dict) -> None:
    """A pool too small for both requests preempts one; on resume it reloads its prefix
    (prompt + generated tokens saved before preemption) from the store, byte-exact."""
    e = Engine(store_ns, num_blocks=14)
    a = e.add("a", A + [9] * 60, max_tokens=20)
    b = e.add("b", list(range(300, 380)), max_tokens=20)
    logs = e.run(200)
    assert a.num_preemptions + b.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 20
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads]  # the resumed request loaded
    _no_byte_errors(e)
    _drained(e)


@pytest.mark.mooncake
def test_multi_turn_on_mooncake(mooncake_master: str, store_ns: dict) -> None:
    """The same conversation through a real mooncake_master."""
    cfg = {"store": "mooncake", "master_address": mooncake_master,
           "namespace": store_ns["namespace"] + "-mc"}
    e1 = Engine(cfg)
    e1.add("t1", A, max_tokens=2)
    e1.run()
    _drained(e1)
    e2 = Engine(cfg)
    e2.add("t2", list(A) + [4, 5], max_tokens=1)
    logs = e2.run()
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    _no_byte_errors(e2)
    _drained(e2)
    e1.shutdown()
    e2.shutdown()


def test_startup_rejects_non_align_mamba_and_sync_hybrid_loads(store_ns: dict) -> None:
    import torch
    from engine_sim import kv_cache_config, vllm_config
    from vllm.v1.kv_cache_interface import MambaSpec

    from tailproof.impl.config import ConfigError, geometry_from_vllm

    vc = vllm_config(store_ns)
    kvc = kv_cache_config(32, (("full_attention", 16), ("mamba", 16)), 4)
    kvc.kv_cache_groups[1].kv_cache_spec = MambaSpec(
        block_size=16, shapes=((3,), (5,)), dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="none")
    with pytest.raises(ConfigError, match="align"):
        geometry_from_vllm(vc, kvc)
    with pytest.raises(ConfigError, match="load_async=false"):
        Engine(dict(store_ns, load_async=False))
    with pytest.raises(ConfigError, match="unknown key"):
        Engine(dict(store_ns, save_decode=True))


def test_finish_time_handoff_of_aborted_producer(store_ns: dict) -> None:
    """A producer aborted with exactly ck(P) computed hands its tail off at finish
    (``register_finished_partial_tail``): pinned before cleanup, stored by the next step."""
    from vllm.v1.request import RequestStatus

    e1 = Engine(store_ns)
    e1.add("p", A, max_tokens=4)
    assert e1.step().scheduled == {"p": 32}
    assert e1.step().scheduled == {"p": 12}  # computed = ck(45) = 44, nothing in flight
    e1.sched.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    side = e1.conn.scheduler_side
    assert list(side.finished_partial_tails) == ["p"]
    job = side.finished_partial_tails["p"]
    assert [(p.group_id, p.num_tokens) for p in job.boundary_puts] == [(0, 44), (1, 44)]
    assert job.store_job_id in side.held  # pinned while the request still owned the blocks
    e1.run()
    _drained(e1)
    e2 = Engine(store_ns)
    e2.add("c", A + [1, 2], max_tokens=1)
    logs = e2.run()
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    _no_byte_errors(e2)
    _drained(e2)


def test_smaller_attention_blocks_put_their_tail_blocks(store_ns: dict) -> None:
    """FA block 8 < Mamba block 16 (lcm 16): normal saves stop at the lcm floor (32), so the
    FA blocks of [32, 44) are put explicitly as tail puts; a consumer loads 44 byte-exact."""
    groups = (("full_attention", 8), ("mamba", 16))
    e1 = Engine(store_ns, groups=groups)
    e1.add("p", A, max_tokens=2)
    logs = e1.run()
    fa_tail = sorted(p.num_tokens for log in logs for s in log.stores for p in s.boundary_puts
                     if p.group_id == 0)
    assert fa_tail == [40, 44]
    _drained(e1)
    e2 = Engine(store_ns, groups=groups)
    e2.add("c", A + [3, 3, 3], max_tokens=1)
    logs2 = e2.run()
    assert [j.kvpool_cached_tokens for log in logs2 for j in log.loads] == [44]
    _no_byte_errors(e2)
    _drained(e2)


@pytest.mark.parametrize("fail", [False, True])
def test_single_group_sync_loads(store_ns: dict, fail: bool) -> None:
    """One KV cache group allows load_async=false: the load feeds the same step's forward;
    a failed one is reported by block id and vLLM recomputes from the first bad block."""
    groups = (("full_attention", 16),)
    cfg = dict(store_ns, load_async=False)
    e1 = Engine(cfg, groups=groups, h=16)
    e1.add("p", list(range(10, 60)), max_tokens=1)  # 50 tokens: 3 full blocks saved
    e1.run()
    _drained(e1)
    e2 = Engine(cfg, groups=groups, h=16)
    if fail:
        from tailproof.impl.stores import Outcome

        e2.conn.store.faults.script("get", [None, Outcome.miss()])
    req = e2.add("c", list(range(10, 60)) + [1], max_tokens=1)
    logs = e2.run()
    loads = [j for log in logs for j in log.loads]
    assert [(j.kvpool_cached_tokens, j.is_async) for j in loads] == [(48, False)]
    assert logs[0].scheduled["c"] == 51 - 48  # the load fed the same step's forward
    if fail:
        # vLLM rolled back to the first failed block and recomputed from there.
        assert sum(log.scheduled.get("c", 0) for log in logs) > 3
    else:
        _no_byte_errors(e2)
    assert req.num_output_tokens == 1
    _drained(e2)


def test_memory_store_rejected_with_several_worker_processes(store_ns: dict) -> None:
    from engine_sim import kv_cache_config, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tailproof.impl.config import ConfigError

    vc = vllm_config(store_ns)
    vc.parallel_config.tensor_parallel_size = 2
    kvc = kv_cache_config(32, (("full_attention", 16), ("mamba", 16)), 4)
    with pytest.raises(ConfigError, match="mooncake"):
        TailproofConnector(vc, KVConnectorRole.SCHEDULER, kvc)


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_memory_store_rejected_with_an_out_of_process_worker(store_ns: dict,
                                                            backend: str) -> None:
    """TP=1 with the multiprocessing or Ray executor still runs the worker in another process
    than the scheduler: the memory store would never hit, so it is refused with the fix."""
    from engine_sim import kv_cache_config, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tailproof.impl.config import ConfigError

    vc = vllm_config(store_ns)
    assert vc.parallel_config.distributed_executor_backend == "uni"  # vLLM's TP=1 default
    vc.parallel_config.distributed_executor_backend = backend
    kvc = kv_cache_config(32, (("full_attention", 16), ("mamba", 16)), 4)
    with pytest.raises(ConfigError, match=f"distributed_executor_backend='{backend}'.*mooncake"):
        TailproofConnector(vc, KVConnectorRole.SCHEDULER, kvc)


def test_memory_store_placement_rule() -> None:
    from types import SimpleNamespace

    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    from tailproof.impl.config import check_store_placement

    def pc(backend: object, tp: int = 1) -> SimpleNamespace:
        return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                               distributed_executor_backend=backend)

    for ok in ("uni", "external_launcher", None, ExecutorWithExternalLauncher):
        assert check_store_placement("memory", pc(ok)) == [], ok
    for bad in ("mp", "ray", object):
        assert check_store_placement("memory", pc(bad)), bad
    assert check_store_placement("memory", pc("uni", tp=2))
    assert check_store_placement("mooncake", pc("mp", tp=2)) == []


def test_keys_carry_the_layout_fingerprint(store_ns: dict) -> None:
    from tailproof.impl.keys import parse_key

    e = Engine(store_ns)
    assert e.conn.settings.namespace == store_ns["namespace"]
    geo = e.conn.fingerprint.parts["geometry"]
    assert (geo["block_sizes"], geo["h"]) == ([16, 16], 4)
    key = e.workers[0][0].worker_side.key(0, b"\x01")
    assert parse_key(key).fingerprint == e.conn.fingerprint.digest
    e.shutdown()


@pytest.mark.mooncake
def test_reset_on_one_engine_leaves_another_engines_hits(mooncake_master: str,
                                                        store_ns: dict) -> None:
    """Two engines share one real master and one namespace. Engine 1 resets its prefix cache
    (as after a weight update): it no longer finds the stored prefix, engine 2 still does."""
    cfg = {"store": "mooncake", "master_address": mooncake_master,
           "namespace": store_ns["namespace"] + "-mc"}
    e1 = Engine(cfg)
    e1.add("t1", A, max_tokens=2)
    e1.run()
    _drained(e1)
    e2 = Engine(cfg)
    assert e1.sched.reset_prefix_cache(reset_connector=True)
    e1.add("again", list(A) + [4, 5], max_tokens=1)
    assert [j.kvpool_cached_tokens for log in e1.run() for j in log.loads] == []  # keys moved
    e2.add("t2", list(A) + [4, 5], max_tokens=1)
    assert [j.kvpool_cached_tokens for log in e2.run() for j in log.loads] == [44]  # untouched
    _no_byte_errors(e2)
    _drained(e2)
    e1.shutdown()
    e2.shutdown()


def _decode_then_reset(e: Any, prompts: dict[str, list[int]], steps: int,
                       max_tokens: int = 12) -> tuple[dict[str, Any], list[Any]]:
    """Add ``prompts``, run ``steps`` steps (prefill + decodes), then
    ``reset_prefix_cache(reset_running_requests=True)`` with every request still running;
    run to the end. Returns the requests and the logs after the reset."""
    reqs = {rid: e.add(rid, p, max_tokens=max_tokens) for rid, p in prompts.items()}
    for _ in range(steps):
        e.step()
    running = {r.request_id for r in e.sched.running}
    assert running == set(prompts)  # still decoding when the reset comes
    assert e.sched.reset_prefix_cache(reset_running_requests=True)
    return reqs, e.run(60)


def test_reset_with_running_requests_finishes_them(store_ns: dict) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` while requests decode with store
    hits: the next step re-admits them with an asynchronous load and reports them preempted
    in the same output; the load is issued (vLLM 0.33's own connector drops it and they wait
    in WAITING_FOR_REMOTE_KVS forever), byte-exact, and every request finishes with the
    tokens an engine without the reset gives."""
    prompts = {"c1": A + [7] * 20 + [1, 2, 3], "c2": A + [5] * 9}
    e1 = Engine(store_ns)
    e1.add("p", A + [7] * 20, max_tokens=2)
    e1.run()
    _drained(e1)
    plain = Engine(store_ns)
    want = {rid: plain.add(rid, p, max_tokens=12) for rid, p in prompts.items()}
    plain.run()
    e2 = Engine(store_ns)
    reqs, logs = _decode_then_reset(e2, prompts, steps=5)
    first_loads = [log.loads for log in e2.log[:5]]
    assert any(first_loads)  # the requests started with store hits
    assert sorted(j.req_id for j in logs[0].loads) == ["c1", "c2"]  # re-admitted, loaded
    for rid, r in reqs.items():
        assert r.status.name == "FINISHED_LENGTH_CAPPED", (rid, r.status)
        assert list(r.output_token_ids) == list(want[rid].output_token_ids)
    assert e2.conn.scheduler_side.metrics.c.total("readmitted_after_preemption") == 2
    _no_byte_errors(e2)
    _drained(e2)
    for e in (e1, plain, e2):
        e.shutdown()


@pytest.mark.parametrize("v2_runner", [False, True])
def test_reset_with_running_requests_resumes_and_saves_without_a_hit(store_ns: dict,
                                                                     v2_runner: bool) -> None:
    """Without a store hit the re-admission is synchronous: a resumed request for Model Runner
    V1, a new one for V2 (``Scheduler.schedule`` SC:1642-1644). It is tracked again and its
    re-prefill (prompt + the outputs before the reset) saved. Before the fix the connector had
    dropped its entry: V2's new request raised ``KeyError`` in the scheduler, V1's resumed one
    was never saved again."""
    e = Engine(dict(store_ns, enable_lookup=False))
    e.sched.use_v2_model_runner = v2_runner
    reqs, logs = _decode_then_reset(e, {"a": A + [3] * 20}, steps=4)
    assert reqs["a"].status.name == "FINISHED_LENGTH_CAPPED"
    assert logs[0].scheduled == {"a": 64}  # recomputed from 0: prompt + 3 outputs = 68
    saved = [(s.token_ids_start, s.token_len_chunk, s.publish_partial_tail)
             for log in logs for s in log.stores if s.req_id == "a"]
    # The re-prefill's blocks, then its partial tail (before the fix: untracked, not saved).
    assert saved == [(0, 64, False), (64, 64, True)]
    _drained(e)
    e.shutdown()
