"""In vLLM's real engine (test bed: core and worker in the bed process, memory store):
a multi-turn workload with the reuse extension off and on (``"auto"``), and ``TAILPROOF_RECORD``.

Each turn's prompt is the conversation so far plus new user text; the device prefix cache is
reset before every turn, so every prefix hit is served by the store. The engine with the
extension off records its run (``TAILPROOF_RECORD``); its trace is replayed afterwards.
Oracle: both engines' greedy outputs are equal turn by turn (turn 1 is cold on both), and the
extension serves more prompt tokens from the store (vLLM's own ``num_cached_tokens``). A third
engine, without a connector, runs the same workload (outputs equal) and records a core-only
trace. Every engine keeps Mamba states densely (``DENSE_RETENTION``), the retention the traces'
adapters model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.realengine.bed import Bed, EngineSpec, memory_connector

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm]

TURNS, USERS, MAX_TOKENS = 3, 3, 24
#: vLLM's engine default (0.33, 0.34) ``prefix_cache_retention_interval=0`` keeps Mamba states
#: sparsely (``MambaManager.reachable_block_mask``: a decode step that fills a block caches no
#: state and offers no aligned offload); the trace format and its adapters model dense retention
#: (``None``, ``KVCacheConfig``'s default), and the recorder flags sparse retention as unmodelled.
DENSE_RETENTION: dict[str, Any] = {"prefix_cache_retention_interval": None}
EXTENSION = {"turn_end_checkpoints": "auto", "decode_boundary_saves": "auto",
             "junction_checkpoints": "auto"}


def _text(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids of the model's vocabulary (3..62)."""
    return [(seed * 131 + j * 17 + (j * j) % 7) % 60 + 3 for j in range(n)]


def _conversations(extra: dict[str, Any] | None, record: Path | None
                   ) -> tuple[list[list[list[int]]], list[int]]:
    """Run the workload on a fresh engine: (outputs per turn per user, prompt tokens served
    from the store per turn: vLLM's ``num_cached_tokens`` after a device-cache reset)."""
    env = {"TAILPROOF_RECORD": str(record)} if record is not None else {}
    kt = None if extra is None else memory_connector(f"rt-reuse-{bool(extra)}", **extra)
    spec = EngineSpec(kv_transfer_config=kt, env=env, engine_args=DENSE_RETENTION)
    with Bed(spec) as bed:
        system = _text(30, 200)
        hist = [system + _text(31 + u, 30 + 40 * u) for u in range(USERS)]
        outs: list[list[list[int]]] = []
        served: list[int] = []
        for turn in range(TURNS):
            assert bed.reset_prefix_cache()
            res = bed.generate(hist, MAX_TOKENS)
            outs.append([list(c.tokens) for c in res])
            served.append(sum(c.num_cached_tokens for c in res))
            hist = [h + o + _text(40 + 10 * turn + u, 37 + 5 * u)
                    for u, (h, o) in enumerate(zip(hist, outs[-1], strict=True))]
    return outs, served  # the trace is closed when the bed's engine shut down


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("record")
    trace, core_trace = folder / "engine-trace.json", folder / "core-trace.json"
    off = _conversations({}, trace)
    on = _conversations(EXTENSION, None)
    core = _conversations(None, core_trace)  # no connector: the core alone
    yield {"off": off, "on": on, "core": core, "trace": trace, "core_trace": core_trace}


def test_extension_outputs_equal_and_more_tokens_from_the_store(runs: dict[str, Any]) -> None:
    (off_out, off_served), (on_out, on_served) = runs["off"], runs["on"]
    assert on_out == off_out == runs["core"][0]  # with the extension, without, no connector
    assert off_served[0] > 0  # the shared system prompt hits across users even on turn 1
    assert sum(on_served[1:]) > sum(off_served[1:]), (on_served, off_served)


def test_recorded_trace_carries_the_connector_and_the_core(runs: dict[str, Any]) -> None:
    """``TAILPROOF_RECORD`` in the real engine writes a trace with the core's and, its worker
    living in the engine core's process, the connector's ops (``plugin.in_process_workers``)."""
    from tailproof.conformance.format.trace import load_trace

    path: Path = runs["trace"]
    assert path.exists(), "the engine wrote no trace"
    trace = load_trace(path)
    names = {o["op"] for o in trace.ops}
    assert {"allocate", "commit", "new_step"} <= names
    assert {"conn_step", "sched_lookup", "worker_run", "worker_report"} <= names


def test_core_trace_replays_on_reference_and_vllm(runs: dict[str, Any]) -> None:
    """Recorded without a connector: the trace replays with 0 divergences on the reference and
    on vLLM's own ``KVCacheManager``."""
    from tailproof.conformance.format.trace import load_trace
    from tailproof.conformance.harness.replay import run_trace

    trace = load_trace(runs["core_trace"])
    assert len(trace.ops) > 100
    result = run_trace(trace, ["reference", "vllm"], strict=True)
    assert result.refused == {} and result.divergences == []


def test_recorded_trace_replays(runs: dict[str, Any]) -> None:
    """The engine's own trace replays with 0 divergences on the reference and, as it carries
    the connector's ops, on ``impl``."""
    from tailproof.conformance.format.trace import load_trace
    from tailproof.conformance.harness.replay import run_trace

    result = run_trace(load_trace(runs["trace"]), ["reference", "impl"], strict=True)
    assert result.refused == {} and result.divergences == []
