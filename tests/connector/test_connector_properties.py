"""Property: on random mixed core + connector traces (scripted store failures included) the
reference connector and vLLM 0.33's Mooncake connector observe exactly the same thing, block ids
included. On a divergence hypothesis shrinks the trace and the minimal one is written to
``tests/connector/failures/`` as a corpus-ready file (set ``TAILPROOF_CONN_EXAMPLES`` to run more
or fewer than the default 400 traces). Connector traces with a sliding-window group beside FA
and Mamba are drawn on their own (``TAILPROOF_CONN_WINDOW_EXAMPLES``, default 40)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

from hypothesis import HealthCheck, given, settings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import (  # noqa: E402
    WINDOW_GEOMETRIES,
    ConnectorDivergence,
    Run,
    connector_trace,
)

from tailproof.conformance.format.ops import CONNECTOR_OPS  # noqa: E402
from tailproof.conformance.tools.generate import write_case  # noqa: E402

FAILURES = Path(__file__).resolve().parent / "failures"
EXAMPLES = int(os.environ.get("TAILPROOF_CONN_EXAMPLES", "400"))
WINDOW_EXAMPLES = int(os.environ.get("TAILPROOF_CONN_WINDOW_EXAMPLES", "40"))


def _check(examples: int, name: str, geometries: list[Any] | None = None) -> list[int]:
    """Run ``examples`` traces (on ``geometries``, default the strategy's); returns
    [traces, ops]; writes the shrunk divergence, if any."""
    seen = [0, 0]

    coverage: Counter[str] = Counter()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(connector_trace(geometries, spec_blocks=True))
    def run(r: Run) -> None:
        seen[0] += 1
        seen[1] += len(r.ops)
        coverage.update(op["op"] for op in r.ops)
        coverage.update("conn_step.offer" for op in r.ops if op.get("offer"))
        coverage.update("groups.num_speculative_blocks" for g in r.config_doc["groups"]
                        if g.get("num_speculative_blocks"))
        # I14 liveness: once every worker ran its queue and reported, no job holds a pin, and
        # every block still referenced is referenced by a request table (snapshot refcounts
        # are then exactly the tables' multiplicities, checked by the core's own tests).
        state = r.observed[-2]
        assert state["held"] == [] and state["pending_push"] is False, state

    try:
        run()
        print(f"\n{name}: op coverage over {seen[0]} traces: "
              + ", ".join(f"{k}={v}" for k, v in sorted(coverage.items())))
        missing = sorted(set(CONNECTOR_OPS) - set(coverage) - {"store_seed", "store_remove",
                                                               "store_keys"})
        assert examples < 100 or (not missing and coverage["conn_step.offer"]
                                  and coverage["groups.num_speculative_blocks"]), missing
    except ConnectorDivergence as e:
        path = write_case(e.doc, FAILURES / f"{name}.json")
        raise AssertionError(f"{e}\nminimal trace ({len(e.doc['ops'])} ops): {path}") from None
    return seen


def test_reference_connector_matches_vllm_mooncake() -> None:
    traces, ops = _check(EXAMPLES, "conn_divergence_min")
    assert traces >= min(EXAMPLES, 300) * 0.9
    assert ops > 20 * traces


def test_reference_connector_matches_vllm_mooncake_with_a_window() -> None:
    """The store path with a sliding-window group (store_mask / lookup_mask, null window
    blocks in the tables of requests past their window or with a window hit)."""
    traces, ops = _check(WINDOW_EXAMPLES, "conn_window_divergence_min", WINDOW_GEOMETRIES)
    assert traces >= WINDOW_EXAMPLES * 0.9
    assert ops > 20 * traces


def test_a_broken_reference_is_caught_and_shrunk(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """Mutation check of the harness itself: a reference that forgets the attention tail puts
    must be caught, and the written trace must be short."""
    from tailproof.reference.connector import scheduler

    monkeypatch.setattr(scheduler, "partial_tail_puts", lambda geo, job: [])
    monkeypatch.setattr(sys.modules[__name__], "FAILURES", tmp_path)
    with pytest.raises(AssertionError, match="minimal trace") as info:
        _check(200, "mutant")
    written = tmp_path / "mutant.json"
    assert written.exists()
    # The dropped tail puts surface where a job with a partial tail is emitted: a step's save
    # (conn_step) or a finishing request's hand-off (conn_finish); hypothesis may find either.
    assert any(op in str(info.value) for op in ("conn_step", "conn_finish")), info.value
