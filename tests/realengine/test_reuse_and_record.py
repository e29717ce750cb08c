"""In vLLM 0.33's real engine (engine core in its own process, ``uni`` executor, memory store):
a multi-turn workload with the reuse extension off and on (``"auto"``), and ``TAILPROOF_RECORD``.

Each turn's prompt is the conversation so far plus new user text; the device prefix cache is
reset before every turn, so every prefix hit is served by the store. The engine with the
extension off records its run (``TAILPROOF_RECORD``); its trace is replayed afterwards.
Oracle: both engines' greedy outputs are equal turn by turn (turn 1 is cold on both), and the
extension serves more prompt tokens from the store (vLLM's own ``num_cached_tokens``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import ENGINE_ARGS, greedy, kv_transfer_config, prompt, require_testbed

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

TURNS, USERS, MAX_TOKENS = 3, 3, 24
EXTENSION = {"turn_end_checkpoints": "auto", "decode_boundary_saves": "auto",
             "junction_checkpoints": "auto"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tailproof.conformance.realengine.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"), seed=0)


def _conversations(model_dir: Path, extra: dict[str, Any], record: Path | None
                   ) -> tuple[list[list[list[int]]], list[int]]:
    """Run the workload on a fresh engine: (outputs per turn per user, store-served prompt
    tokens per turn)."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    require_testbed()
    kt = kv_transfer_config({"store": "memory", "namespace": f"rt-reuse-{bool(extra)}",
                             **extra})
    old = os.environ.get("TAILPROOF_RECORD")
    if record is not None:
        os.environ["TAILPROOF_RECORD"] = str(record)  # read by the engine core at its start
    try:
        llm = LLM(model=str(model_dir), kv_transfer_config=kt, **ENGINE_ARGS)
    finally:
        if old is None:
            os.environ.pop("TAILPROOF_RECORD", None)
        else:
            os.environ["TAILPROOF_RECORD"] = old
    try:
        system = prompt(30, 200)
        hist = [prompt(31 + u, 230 + 40 * u, shared=system) for u in range(USERS)]
        outs: list[list[list[int]]] = []
        served: list[int] = []
        for turn in range(TURNS):
            assert llm.reset_prefix_cache()
            res = llm.generate([TokensPrompt(prompt_token_ids=h) for h in hist],
                               greedy(MAX_TOKENS), use_tqdm=False)
            outs.append([list(r.outputs[0].token_ids) for r in res])
            served.append(sum(r.num_cached_tokens or 0 for r in res))
            hist = [h + o + prompt(40 + 10 * turn + u, 37 + 5 * u)
                    for u, (h, o) in enumerate(zip(hist, outs[-1], strict=True))]
        return outs, served
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    trace = tmp_path_factory.mktemp("record") / "engine-trace.json"
    off = _conversations(model_dir, {}, trace)
    on = _conversations(model_dir, EXTENSION, None)
    yield {"off": off, "on": on, "trace": trace}


def test_extension_outputs_equal_and_more_tokens_from_the_store(runs: dict[str, Any]) -> None:
    (off_out, off_served), (on_out, on_served) = runs["off"], runs["on"]
    assert on_out == off_out
    assert off_served[0] > 0  # the shared system prompt hits across users even on turn 1
    assert sum(on_served[1:]) > sum(off_served[1:]), (on_served, off_served)


def test_recorded_trace_replays(runs: dict[str, Any]) -> None:
    """The engine's own trace replays with 0 divergences on the reference and vLLM 0.33's
    ``KVCacheManager``, and, as it carries the connector's ops, on ``impl``."""
    from tailproof.conformance.replay import run_trace
    from tailproof.conformance.trace import load_trace

    path: Path = runs["trace"]
    assert path.exists(), "the engine wrote no trace"
    trace = load_trace(path)
    assert len(trace.ops) > 100
    assert run_trace(trace, ["reference", "vllm"], strict=True).divergences == []
    conn_ops = [o for o in trace.ops if o["op"].startswith("conn_")]
    assert conn_ops, "the trace carries no connector ops"
    assert run_trace(load_trace(path), ["reference", "impl"], strict=True).divergences == []
