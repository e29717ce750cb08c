"""Property: on random connector traces with the turn-end checkpoint extension on (drawn slot
and reserve bounds, decode boundary saves, junction checkpoints with a large or a tiny prompt
index, scripted store failures, preemptions, two workers)
the reference connector model and ``tailproof.impl`` observe exactly the same thing, block ids
included, and every put and load of ``impl`` moves the right KV bytes (``runner_sim``). On a
divergence the shrunk trace is written to ``tests/connector/failures/``
(``TAILPROOF_REUSE_EXAMPLES`` traces, default 60)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

from hypothesis import HealthCheck, given, settings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import EXTENSION_GEOMETRIES, ConnectorDivergence, Run, connector_trace  # noqa: E402

from tailproof.conformance.tools.generate import write_case  # noqa: E402

FAILURES = Path(__file__).resolve().parent / "failures"
EXAMPLES = int(os.environ.get("TAILPROOF_REUSE_EXAMPLES", "60"))


def test_reference_and_impl_agree_with_turn_end_checkpoints() -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(connector_trace(EXTENSION_GEOMETRIES, max_steps=30, extension=True))
    def run(r: Run) -> None:
        seen["traces"] += 1
        for obs in r.observed:
            if obs is None:
                continue
            seen["deferred"] += "ext" in obs and obs["ext"] is None
            seen["snapshots"] += len(obs.get("snapshots") or [])
            seen["turn_end_jobs"] += obs.get("turn_end") is not None
            seen["errors"] += "error" in obs
            seen["loads"] += len(obs.get("loads") or [])
            seen["junctions"] += bool(obs.get("junction")) and "ext" in obs  # sched_lookup
        state = r.observed[-2]  # after every worker ran and reported: nothing held
        assert state["held"] == [] and state["pending_push"] is False, state

    try:
        run()
    except ConnectorDivergence as e:
        path = write_case(e.doc, FAILURES / "reuse_divergence_min.json")
        raise AssertionError(f"{e}\nminimal trace ({len(e.doc['ops'])} ops): {path}") from None
    print(f"\nextension traces: {dict(seen)}")
    assert seen["traces"] >= EXAMPLES * 0.9
    if EXAMPLES >= 40:
        assert seen["snapshots"] > 0 and seen["turn_end_jobs"] > 0
