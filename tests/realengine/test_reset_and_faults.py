"""In vLLM 0.33's real engine (in-process core, ``uni`` executor, memory store): a prefix-cache
reset with running requests that decode with store hits, every stored value failing
verification, and ``kv_load_failure_policy`` ``fail``.

One engine serves the module. The oracle is greedy output equality with the module's first
pass: cold, on an empty store namespace, prompts that share no block with each other (so no
prefix hit of any kind served it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import generate, greedy, in_process_llm, kv_transfer_config, prompt, scheduler

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

MAX_TOKENS = 24
PROMPTS = [prompt(s, n) for s, n in ((1, 150), (2, 290), (3, 333), (4, 520))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tailproof.conformance.realengine.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def bed(model_dir: Path) -> Iterator[tuple[Any, list[list[int]]]]:
    """(the engine, the cold outputs of ``PROMPTS``)."""
    kt = kv_transfer_config({"store": "memory", "namespace": "rt-reset-faults",
                             "capacity_bytes": 1 << 28})
    with in_process_llm(model_dir, kt) as llm:
        cold = generate(llm, PROMPTS, MAX_TOKENS)
        yield llm, cold


def _connector(llm: Any) -> Any:
    return scheduler(llm).connector


def _worker_total(llm: Any, name: str) -> int:
    """A worker-side counter of the in-process worker's connector, since start."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.metrics.c.total(name)


def _drain_pins(llm: Any) -> None:
    """Step the idle engine until every store job reported (pins hold device blocks, and a
    reset needs every block free)."""
    eng = llm.llm_engine
    for _ in range(500):
        if not _connector(llm).has_pending_push_work():
            return
        eng.step()
    raise AssertionError("store jobs never reported")


def _store_hit_pass(llm: Any) -> list[list[int]]:
    """Device prefix cache reset (idle engine), then ``PROMPTS`` again: hits from the store."""
    _drain_pins(llm)
    assert llm.reset_prefix_cache()
    return generate(llm, PROMPTS, MAX_TOKENS)


def test_store_hits_equal_cold(bed: tuple[Any, list[list[int]]]) -> None:
    llm, cold = bed
    gets = _worker_total(llm, "get_keys")
    assert _store_hit_pass(llm) == cold
    assert _worker_total(llm, "get_keys") > gets  # served by store loads


def test_reset_with_running_requests_all_finish(bed: tuple[Any, list[list[int]]]) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` while every request decodes with a
    store hit: vLLM re-admits them in the next step with a store load and reports them
    preempted in the same output; every request finishes (no WAITING_FOR_REMOTE_KVS hang)
    with the cold outputs."""
    from vllm.inputs import TokensPrompt

    llm, cold = bed
    _drain_pins(llm)
    assert llm.reset_prefix_cache()
    eng, sched = llm.llm_engine, scheduler(llm)
    side = _connector(llm).scheduler_side
    gets0 = _worker_total(llm, "get_keys")
    readmitted0 = side.metrics.c.total("readmitted_after_preemption")
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"rr{i}", TokensPrompt(prompt_token_ids=p), greedy(MAX_TOKENS))
    for _ in range(2000):  # until every request decodes (has output tokens)
        eng.step()
        running = [r for r in sched.running if r.num_output_tokens >= 2]
        if len(running) == len(PROMPTS):
            break
    else:
        raise AssertionError("the requests never all decoded")
    gets1 = _worker_total(llm, "get_keys")
    assert gets1 > gets0  # they started from store hits
    _wait_pins_while_running(llm)
    assert llm.reset_prefix_cache(reset_running_requests=True)
    done: dict[str, list[int]] = {}
    for _ in range(5000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not eng.has_unfinished_requests():
            break
    stuck = {r.request_id: r.status.name for r in sched.requests.values()}
    assert not stuck, f"requests left unfinished: {stuck}"
    assert [done[f"rr{i}"] for i in range(len(PROMPTS))] == cold
    assert _worker_total(llm, "get_keys") > gets1  # re-admitted with store loads
    assert side.metrics.c.total("readmitted_after_preemption") - readmitted0 == len(PROMPTS)


def _wait_pins_while_running(llm: Any) -> None:
    """Step (requests keep decoding) until no store job holds a pin: the reset then finds
    every block free once the running requests are preempted."""
    eng = llm.llm_engine
    for _ in range(500):
        if not _connector(llm).has_pending_push_work():
            return
        eng.step()
    raise AssertionError("store jobs never reported")


def test_every_stored_value_failing_verification_is_recomputed(
        bed: tuple[Any, list[list[int]]]) -> None:
    """Flip one payload byte of every value in the store: every load fails its checksum,
    fails closed, is recomputed; outputs stay the cold ones, the engine keeps serving."""
    from tailproof.impl.value_format import HEADER_BYTES

    llm, cold = bed
    _drain_pins(llm)
    store = _connector(llm).store
    values = list(store._data.values())  # the memory store's held values (test access)
    assert values
    for v in values:
        v[HEADER_BYTES + 5] ^= 1
    failed0 = _worker_total(llm, "verify_fail_checksum")
    assert _store_hit_pass(llm) == cold
    assert _worker_total(llm, "verify_fail_checksum") > failed0
    assert _store_hit_pass(llm) == cold  # the rejected values were removed and re-saved


def test_fail_policy_errors_the_request_and_the_engine_survives(
        bed: tuple[Any, list[list[int]]]) -> None:
    """``kv_load_failure_policy='fail'``: a request whose store load fails ends with an error;
    the next requests are served, output-equal. The policy is vLLM's scheduler flag
    ``recompute_kv_load_failures`` (``Scheduler.__init__`` SC:186-187), set here on the
    module's engine instead of starting another (an engine start costs most of this module)."""
    from vllm.inputs import TokensPrompt

    from tailproof.impl.stores import Outcome

    llm, cold = bed
    sched = scheduler(llm)
    _drain_pins(llm)
    assert llm.reset_prefix_cache()
    store = _connector(llm).store
    sched.recompute_kv_load_failures = False
    try:
        store.faults.script("get", [Outcome.miss()] * 1000)
        eng = llm.llm_engine
        eng.add_request("fail0", TokensPrompt(prompt_token_ids=PROMPTS[3]), greedy(MAX_TOKENS))
        outs = []
        for _ in range(2000):
            outs += [o for o in eng.step() if o.finished]
            if not eng.has_unfinished_requests():
                break
        assert [o.request_id for o in outs] == ["fail0"]
        assert outs[0].outputs[0].finish_reason == "error"
    finally:
        store.faults.clear()
        sched.recompute_kv_load_failures = True
    assert _store_hit_pass(llm) == cold  # the engine survived and serves hits again
