"""Connector recording: vLLM 0.33's real Scheduler with ``TailproofConnector`` (workers
in-process, memory store) recorded with its connector calls and worker runs as connector ops;
the trace replays with no divergence on the reference, vLLM's Mooncake connector and ours."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "impl"))

from engine_sim import Engine  # noqa: E402

from tailproof.conformance.capture.recorder import Recorder  # noqa: E402
from tailproof.conformance.cli.main import main  # noqa: E402

pytestmark = pytest.mark.vllm


def _record(path: Path, num_workers: int, refusals: bool = False) -> Recorder:
    # vLLM 0.33's pin rule (tailproof's readable pins and pin budget off), so that
    # vllm-mooncake replays the trace too (it refuses tailproof's pin rules)
    e = Engine({"store": "memory", "readable_pins": False, "pin_budget_fraction": None},
               num_blocks=128, num_workers=num_workers)
    # Not modelled by the trace format (docs/triage.md): the admission gate and deferred
    # frees (engine_sim's config has several batches in flight).
    e.sched.scheduler_reserve_full_isl = False
    e.sched.defer_block_free = False
    plan = None
    if refusals:
        def plan(rank: int) -> Callable[[], str]:
            r = random.Random(rank)
            return lambda: r.choice(["ok"] * 3 + ["full", "error", "timeout"])
    rec = Recorder.attach(e.sched, path, workers=[wc for wc, _ in e.workers],
                          store_plan=plan)
    rng = random.Random(0)
    system = [rng.randrange(3, 900) for _ in range(70)]
    try:
        for turn in range(5):
            for u in range(3):
                e.add(f"u{u}t{turn}",
                      system + [rng.randrange(3, 900) for _ in range(10 + 7 * turn)],
                      max_tokens=5)
            e.run(200)
            if turn == 2:  # later turns read the store
                assert e.sched.reset_prefix_cache()
        assert not [x for log in e.log for x in log.byte_errors]
    finally:
        rec.close()
        e.shutdown()
    return rec


@pytest.mark.parametrize(("num_workers", "refusals"), [(1, False), (2, False), (2, True)])
def test_connector_trace_replays_on_every_connector_adapter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], num_workers: int,
        refusals: bool) -> None:
    out = tmp_path / "conn.json"
    rec = _record(out, num_workers, refusals)
    assert not any("KV connector" in k for k in rec.unmodelled)
    doc = json.loads(out.read_text())
    assert doc["config"]["connector"]["num_workers"] == num_workers
    kinds = [op["op"] for op in doc["ops"]]
    for kind in ("sched_lookup", "conn_step", "conn_finish", "worker_run", "worker_report"):
        assert kind in kinds
    assert kinds.count("worker_run") == num_workers * kinds.count("conn_step")
    hits = [op for op in doc["ops"] if op["op"] == "sched_lookup" and op["expect"]["ext"]]
    # After the reset the store serves hits: loads ran (byte-checked by the engine and impl).
    # With half the put batches refused, some keys stay absent (fail closed): checked below.
    assert hits or refusals
    scripts = [e for op in doc["ops"] if op["op"] == "worker_run" for e in op.get("store", [])]
    assert bool(scripts) == refusals
    if refusals:
        assert {"full", "error", "raise"} <= set(scripts)
    capsys.readouterr()
    assert main(["replay", str(out), "--against", "reference,vllm-mooncake,impl",
                 "--strict-ids", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ops"] >= 500 and summary["divergences"] == []
    if refusals:  # the recorded script is what the engine's store did: without it, a hit
        for op in doc["ops"]:
            op.pop("store", None)
        out.write_text(json.dumps(doc))
        assert main(["replay", str(out), "--against", "reference", "--json"]) == 1
        first = json.loads(capsys.readouterr().out)["divergences"][0]
        assert first["op"] == "sched_lookup"
