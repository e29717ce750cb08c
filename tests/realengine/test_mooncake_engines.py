"""Two of vLLM 0.33's real engines sharing one real ``mooncake_master`` on 127.0.0.1.

Engine A runs its engine core in its own process with the ``mp`` executor (the worker in yet
another process); engine B runs in this process (``uni``). Prefix hashes agree across the two
processes because both use vLLM's default ``sha256`` with no ``PYTHONHASHSEED``: the fixed
``NONE_HASH`` seed (``resolve_none_hash_seed``; docs/impl.md, "Prefix hashes across processes").
The oracle is greedy output equality with A's first, cold pass (empty namespace, prompts that
share no block). Last, the master is killed mid-run: both engines recompute and keep serving.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from serving import (
    ENGINE_ARGS,
    generate,
    generate_counted,
    greedy,
    in_process_llm,
    kv_transfer_config,
    prompt,
    require_testbed,
    scheduler,
)

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm, pytest.mark.mooncake]

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

MAX_TOKENS = 16
PROMPTS = [prompt(s, n) for s, n in ((21, 150), (22, 300), (23, 470))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tailproof.conformance.realengine.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tailproof.conformance.local_master import LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"Mooncake client unavailable: {reason}")
    m = LocalMaster(tmp_path_factory.mktemp("mooncake")).start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def engines(model_dir: Path, master: Any) -> Iterator[dict[str, Any]]:
    """A (own-process core, ``mp`` executor) with its cold outputs; B built lazily."""
    from vllm import LLM

    require_testbed()
    kt = kv_transfer_config({"store": "mooncake", "master_address": master.address,
                             "namespace": "rt-two-engines",
                             "global_segment_size": 64 << 20})
    with ExitStack() as stack:
        a = LLM(model=str(model_dir), kv_transfer_config=kt, distributed_executor_backend="mp",
                **ENGINE_ARGS)
        stack.callback(a.llm_engine.engine_core.shutdown)
        state: dict[str, Any] = {"a": a, "kt": kt, "stack": stack,
                                 "cold": generate(a, PROMPTS, MAX_TOKENS)}
        yield state


def _b(engines: dict[str, Any], model_dir: Path) -> Any:
    if "b" not in engines:
        engines["b"] = engines["stack"].enter_context(in_process_llm(model_dir, engines["kt"]))
    return engines["b"]


def _gets(llm: Any) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.metrics.c.total("get_keys")


def test_mp_executor_store_hits_equal_cold(engines: dict[str, Any]) -> None:
    """A: device prefix cache reset, the same prompts served from the master's store."""
    a, cold = engines["a"], engines["cold"]
    assert a.reset_prefix_cache()
    outs, cached = generate_counted(a, PROMPTS, MAX_TOKENS)
    assert outs == cold
    assert cached > 0  # the device cache was empty: every cached token came from the store


def test_second_engine_serves_the_first_engines_blocks(engines: dict[str, Any],
                                                       model_dir: Path) -> None:
    """B (another process, its device cache empty) serves A's stored prefixes."""
    b = _b(engines, model_dir)
    assert scheduler(b).connector.hash_seed_problem is None
    gets = _gets(b)
    assert generate(b, PROMPTS, MAX_TOKENS) == engines["cold"]
    assert _gets(b) > gets  # hits: the blocks came from A through the store


def test_master_killed_mid_run_recomputes_and_keeps_serving(engines: dict[str, Any],
                                                            master: Any,
                                                            model_dir: Path) -> None:
    """B's requests are decoding after store hits when the master is killed (SIGKILL): they
    finish output-equal, and both engines keep serving (no hit possible, recomputed)."""
    from vllm.inputs import TokensPrompt

    a, b, cold = engines["a"], _b(engines, model_dir), engines["cold"]
    assert a.reset_prefix_cache() and b.reset_prefix_cache()
    eng = b.llm_engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"mk{i}", TokensPrompt(prompt_token_ids=p), greedy(MAX_TOKENS))
    done: dict[str, list[int]] = {}
    killed = False
    for _ in range(5000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        running = scheduler(b).running
        if not killed and running and all(r.num_output_tokens >= 2 for r in running):
            master.kill()
            killed = True
        if not eng.has_unfinished_requests():
            break
    assert killed
    assert [done[f"mk{i}"] for i in range(len(PROMPTS))] == cold
    # Device caches reset first: this module compares store hits and recomputation with the
    # cold pass, never device prefix-cache hits (tests/realengine's own warm tests do).
    assert b.reset_prefix_cache()
    assert generate(b, PROMPTS, MAX_TOKENS) == cold  # the store is gone: recomputed
    assert generate(a, PROMPTS, MAX_TOKENS) == cold  # (reset above, idle since)
