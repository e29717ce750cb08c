"""In vLLM 0.33's real engine (test bed, core in the bed process, ``uni`` executor, memory store):
store hits, a prefix-cache reset with running requests that decode with store hits, every stored
value failing verification (a payload byte; an identity byte), and ``kv_load_failure_policy``
``fail``.

One engine serves the module; the oracle is the session's ground truth (an engine with prefix
caching off, ``conftest.truth``) on a subset of its shared-prefix prompts. Steps that must run
inside the engine (a step loop, the scheduler's state) are module-level functions run in the
bed process through ``Bed.call``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tailproof.conformance.realengine.bed import Bed, EngineSpec, memory_connector
from tailproof.conformance.realengine.oracle import MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

SUBSET = (1, 5, 8, 11)  # prompts of 40+, 150+, 288+ and 515+ tokens sharing base prefixes


@pytest.fixture(scope="module")
def case(prompts: list[list[int]], truth: list[tuple[int, ...]]
         ) -> tuple[list[list[int]], list[list[int]]]:
    return [prompts[i] for i in SUBSET], [list(truth[i]) for i in SUBSET]


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with Bed(EngineSpec(kv_transfer_config=memory_connector("rt-reset-faults"))) as b:
        yield b


# --- run in the bed process (Bed.call) ------------------------------------------------------


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _worker_total(name: str) -> int:
    """A worker-side counter of the in-process worker's connector, since start."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.metrics.c.total(name)


def _greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def drain_pins(llm: Any) -> None:
    """Step until every store job reported: pins hold device blocks, a reset needs them free."""
    for _ in range(1000):
        if not _scheduler(llm).connector.has_pending_push_work():
            return
        llm.llm_engine.step()
    raise AssertionError("store jobs never reported")


def store_hit_pass(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Device prefix cache reset (idle engine), ``prompts`` again: (outputs, keys read from
    the store during the pass)."""
    drain_pins(llm)
    assert llm.reset_prefix_cache()
    gets = _worker_total("get_keys")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(MAX_TOKENS),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], _worker_total("get_keys") - gets


def _run_to_end(llm: Any, done: dict[str, Any]) -> None:
    eng = llm.llm_engine
    for _ in range(20000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if not eng.has_unfinished_requests():
            return


def reset_while_decoding(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Store hits, then ``reset_prefix_cache(reset_running_requests=True)`` once every request
    decodes; run to the end. What happened, as plain data."""
    sched, eng = _scheduler(llm), llm.llm_engine
    drain_pins(llm)
    assert llm.reset_prefix_cache()
    side = sched.connector.scheduler_side
    gets0, readmitted0 = _worker_total("get_keys"), side.metrics.c.total(
        "readmitted_after_preemption")
    for i, p in enumerate(prompts):
        eng.add_request(f"rr{i}", {"prompt_token_ids": p}, _greedy(MAX_TOKENS))
    done: dict[str, Any] = {}
    for _ in range(5000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if len(sched.running) == len(prompts) and all(
                r.num_output_tokens >= 2 for r in sched.running):
            break
    decoding = len(sched.running)
    for _ in range(1000):  # no store job in flight (the reset needs every block free)
        if not sched.connector.has_pending_push_work():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    gets1 = _worker_total("get_keys")
    reset_ok = llm.reset_prefix_cache(reset_running_requests=True)
    _run_to_end(llm, done)
    return {
        "decoding_at_reset": decoding, "reset_ok": reset_ok,
        "outputs": [list(done[f"rr{i}"].token_ids) if f"rr{i}" in done else None
                    for i in range(len(prompts))],
        "stuck": {r.request_id: r.status.name for r in sched.requests.values()},
        "gets_before_reset": gets1 - gets0, "gets_after_reset": _worker_total("get_keys") - gets1,
        "readmitted": side.metrics.c.total("readmitted_after_preemption") - readmitted0,
    }


def corrupt_every_value(llm: Any) -> int:
    """Flip one payload byte of every value the memory store holds; how many."""
    from tailproof.impl.value_format import HEADER_BYTES

    drain_pins(llm)
    values = list(_scheduler(llm).connector.store._data.values())  # test access
    for v in values:
        v[HEADER_BYTES + 5] ^= 1
    return len(values)


def verify_failures(llm: Any) -> int:
    return _worker_total("verify_fail_checksum")


def _worker_store() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.store


def store_hit_pass_reads(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
    """:func:`store_hit_pass`, recording the keys the worker read from the store, in order."""
    store, read = _worker_store(), []
    plain = store.read_batch

    def recording(keys: Any, *args: Any, **kwargs: Any) -> Any:
        read.extend(keys)
        return plain(keys, *args, **kwargs)

    store.read_batch = recording  # test access: an instance attribute shadows the method
    try:
        outs, _ = store_hit_pass(llm, prompts)
    finally:
        del store.read_batch
    return outs, read


def flip_identity_byte(llm: Any, key: str) -> int:
    """Flip one bit in the MAC identity (header byte 96) of the value under ``key``, the key
    unchanged: what a bit flip, or a writer without the secret, leaves under this engine's
    key. The identity byte as it was."""
    drain_pins(llm)
    value = _worker_store()._data[key]  # test access: the memory store's own array
    was = int(value[96])
    value[96] ^= 1
    return was


def identity_byte(llm: Any, key: str) -> int | None:
    value = _worker_store()._data.get(key)
    return None if value is None else int(value[96])


def verify_counters(llm: Any) -> dict[str, int]:
    """The worker's ``verify_*`` counters since start."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    totals = get_kv_transfer_group().worker_side.metrics.c.totals()
    return {k: v for k, v in totals.items() if k.startswith("verify_")}


def fail_policy_run(llm: Any, p: list[int]) -> list[tuple[str, str | None]]:
    """Every store get fails and vLLM's ``recompute_kv_load_failures`` is off (what
    ``kv_load_failure_policy='fail'`` sets, ``Scheduler.__init__`` SC:186-187): the finished
    requests' (id, finish reason)."""
    from tailproof.impl.stores import Outcome

    sched = _scheduler(llm)
    drain_pins(llm)
    assert llm.reset_prefix_cache()
    store = sched.connector.store
    sched.recompute_kv_load_failures = False
    try:
        store.faults.script("get", [Outcome.miss()] * 1000)
        llm.llm_engine.add_request("fail0", {"prompt_token_ids": p}, _greedy(MAX_TOKENS))
        done: dict[str, Any] = {}
        _run_to_end(llm, done)
        return [(rid, o.finish_reason) for rid, o in done.items()]
    finally:
        store.faults.clear()
        sched.recompute_kv_load_failures = True


# --- the tests ------------------------------------------------------------------------------


def test_store_hits_equal_the_truth(bed: Bed, case: tuple[Any, Any]) -> None:
    prompts, want = case
    assert [list(c.tokens) for c in bed.generate(prompts, MAX_TOKENS)] == want  # cold
    outs, gets = bed.call(store_hit_pass, prompts)
    assert outs == want and gets > 0


def test_reset_with_running_requests_all_finish(bed: Bed, case: tuple[Any, Any]) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` while every request decodes after
    a store hit: vLLM re-admits them in the next step with a store load and reports them
    preempted in the same output; every request finishes (before the fix: WAITING_FOR_REMOTE_KVS
    forever) with the truth's tokens."""
    prompts, want = case
    r = bed.call(reset_while_decoding, prompts)
    assert r["decoding_at_reset"] == len(prompts) and r["reset_ok"]
    assert r["stuck"] == {}, f"requests left unfinished: {r['stuck']}"
    assert r["outputs"] == want
    assert r["gets_before_reset"] > 0 and r["gets_after_reset"] > 0  # store hits, both times
    assert r["readmitted"] == len(prompts)


def test_every_stored_value_failing_verification_is_recomputed(
        bed: Bed, case: tuple[Any, Any]) -> None:
    """Every load fails its checksum, fails closed and is recomputed: outputs stay the truth's;
    the rejected values are removed and re-saved, so the next pass hits again."""
    prompts, want = case
    assert bed.call(corrupt_every_value) > 0
    failed0 = bed.call(verify_failures)
    outs, _ = bed.call(store_hit_pass, prompts)
    assert outs == want
    assert bed.call(verify_failures) > failed0
    outs, gets = bed.call(store_hit_pass, prompts)
    assert outs == want and gets > 0


def test_a_flipped_identity_byte_is_recomputed_removed_and_served_again(
        bed: Bed, case: tuple[Any, Any]) -> None:
    """One stored value's header names another MAC identity under this engine's key (one bit
    flipped in the identity, the first value a store-hit pass reads): the load that meets it
    fails closed (``identity``) and is recomputed, so outputs stay the truth's; the value is
    removed and the pass saves it again, so the next pass is served from the store, with no
    failure."""
    prompts, want = case
    bed.call(store_hit_pass, prompts)  # every prefix stored, whichever tests ran before
    outs, read = bed.call(store_hit_pass_reads, prompts)
    assert outs == want and read
    key = read[0]
    was = bed.call(flip_identity_byte, key)
    v0 = bed.call(verify_counters)
    outs, _ = bed.call(store_hit_pass, prompts)
    assert outs == want
    v1 = bed.call(verify_counters)
    delta = {k: v - v0.get(k, 0) for k, v in v1.items() if v != v0.get(k, 0)}
    assert delta == {"verify_fail_identity": 1, "verify_removed": 1}
    assert bed.call(identity_byte, key) == was  # saved again by that pass, as it was
    outs, again = bed.call(store_hit_pass_reads, prompts)
    assert outs == want and key in again  # served from the store again
    assert bed.call(verify_counters) == v1  # without a failure


def test_fail_policy_errors_the_request_and_the_engine_survives(
        bed: Bed, case: tuple[Any, Any]) -> None:
    prompts, want = case
    assert bed.call(fail_policy_run, prompts[-1]) == [("fail0", "error")]
    outs, gets = bed.call(store_hit_pass, prompts)  # the engine survived, serves hits again
    assert outs == want and gets > 0
