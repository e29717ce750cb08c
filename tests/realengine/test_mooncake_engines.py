"""Two of vLLM's real engines (two bed processes) sharing one real ``mooncake_master`` on
127.0.0.1.

Engine A runs its engine core in its own process with the ``mp`` executor (the worker in yet
another process); engine B runs core and worker in its bed process (``uni``). Prefix hashes
agree across the processes because both use vLLM's default ``sha256`` with no
``PYTHONHASHSEED``: the fixed ``NONE_HASH`` seed (``resolve_none_hash_seed``; docs/impl.md,
"Prefix hashes across processes"). The oracle is the session's ground truth (an engine with
prefix caching off). Last, the master is killed while B's requests decode: both engines
recompute and keep serving.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tailproof.conformance.realengine.bed import (
    Bed,
    EngineSpec,
    engine_metrics,
    tailproof_connector,
)
from tailproof.conformance.realengine.oracle import MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm, pytest.mark.mooncake]

SUBSET = (2, 6, 9)  # shared-prefix prompts of 64+, 200+ and 320+ tokens (conftest.prompts)
MC_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def case(prompts: list[list[int]], truth: list[tuple[int, ...]]
         ) -> tuple[list[list[int]], list[list[int]]]:
    return [prompts[i] for i in SUBSET], [list(truth[i]) for i in SUBSET]


def _spec(master: Any, **kw: Any) -> EngineSpec:
    kt = tailproof_connector({"store": "mooncake", "master_address": master.address,
                              "namespace": "rt-two-engines", "global_segment_size": 64 << 20})
    return EngineSpec(kv_transfer_config=kt, env=dict(MC_ENV), **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One model folder for both engines: the fingerprint names the model path
    (``fingerprint.model_identity``), so engines loading the same weights from different
    folders never share keys."""
    from tailproof.conformance.realengine.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def engine_a(master: Any, model_dir: Any) -> Iterator[Bed]:
    with Bed(_spec(master, executor="mp", core_process=True), model_dir=model_dir) as bed:
        yield bed


@pytest.fixture(scope="module")
def engine_b(master: Any, engine_a: Bed, model_dir: Any) -> Iterator[Bed]:
    with Bed(_spec(master), model_dir=model_dir) as bed:
        yield bed


# --- run in B's bed process (Bed.call) ------------------------------------------------------


def hash_seed_problem(llm: Any) -> str | None:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.hash_seed_problem


def kill_master_while_decoding(llm: Any, prompts: list[list[int]], pid: int
                               ) -> tuple[bool, list[list[int] | None]]:
    """Run ``prompts``; once every request decodes, SIGKILL the master (``pid``, started by
    this test); run to the end. (killed, outputs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    for i, p in enumerate(prompts):
        eng.add_request(f"mk{i}", {"prompt_token_ids": p}, sp)
    done: dict[str, list[int]] = {}
    killed = False
    for _ in range(20000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        running = sched.running
        if not killed and len(running) == len(prompts) and all(
                r.num_output_tokens >= 2 for r in running):
            os.kill(pid, signal.SIGKILL)
            killed = True
        if not eng.has_unfinished_requests():
            break
    return killed, [done.get(f"mk{i}") for i in range(len(prompts))]


# --- the tests ------------------------------------------------------------------------------


def test_mp_executor_cold_and_store_hits_equal_the_truth(engine_a: Bed,
                                                          case: tuple[Any, Any]) -> None:
    prompts, want = case
    assert [list(c.tokens) for c in engine_a.generate(prompts, MAX_TOKENS)] == want
    assert engine_a.reset_prefix_cache()
    gets = _gets(engine_a)
    assert [list(c.tokens) for c in engine_a.generate(prompts, MAX_TOKENS)] == want
    assert _gets(engine_a) > gets  # device cache empty: served from the store


def _gets(bed: Bed) -> float:
    """Prompt tokens the engine's connector has served (vLLM's own counter)."""
    return bed.call(engine_metrics).get("vllm:external_prefix_cache_hits", 0.0)


def test_second_engine_serves_the_first_engines_blocks(engine_a: Bed, engine_b: Bed,
                                                       case: tuple[Any, Any]) -> None:
    """B (other processes, its device cache empty) serves what A stored."""
    prompts, want = case
    assert engine_b.call(hash_seed_problem) is None
    assert _gets(engine_b) == 0
    assert [list(c.tokens) for c in engine_b.generate(prompts, MAX_TOKENS)] == want
    assert _gets(engine_b) > 0  # B's first pass: what it loaded, A stored


def test_master_killed_mid_run_recomputes_and_keeps_serving(
        engine_a: Bed, engine_b: Bed, master: Any, case: tuple[Any, Any]) -> None:
    prompts, want = case
    assert engine_a.reset_prefix_cache() and engine_b.reset_prefix_cache()
    pid = master.pid
    assert pid is not None
    killed, outs = engine_b.call(kill_master_while_decoding, prompts, pid)
    assert killed
    assert outs == want
    assert engine_b.reset_prefix_cache()  # store hits or recomputation only, never device
    assert [list(c.tokens) for c in engine_b.generate(prompts, MAX_TOKENS)] == want
    assert [list(c.tokens) for c in engine_a.generate(prompts, MAX_TOKENS)] == want
