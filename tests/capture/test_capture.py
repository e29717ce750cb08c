"""``tailproof capture``: vLLM 0.33's real Scheduler on CPU, recorded by the live-engine
recorder, replays with no divergence; redaction keeps every observation; rotation keeps
memory bounded and the segments join back into the same trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from tailproof.conformance.capture.writer import join_segments  # noqa: E402
from tailproof.conformance.cli.main import main  # noqa: E402
from tailproof.conformance.format.trace import load_trace, parse_trace  # noqa: E402
from tailproof.conformance.harness.corpus import CASES_DIR  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402
from tailproof.conformance.tools.capture_engine.run import CaptureError, capture  # noqa: E402

pytestmark = pytest.mark.vllm


def test_capture_chat_then_replay_json(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    out = tmp_path / "t.json"
    assert main(["capture", "--workload", "chat", "-o", str(out), "--json"]) == 0
    cap = json.loads(capsys.readouterr().out)
    schema = json.loads((CASES_DIR.parent / "schema" / "command.schema.json").read_text())
    jsonschema.validate(cap, schema)
    assert cap["command"] == "capture" and cap["body"]["ops"] >= 500
    assert main(["replay", str(out), "--against", "reference,vllm", "--strict-ids",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ops"] == cap["body"]["ops"] and summary["divergences"] == []
    doc = json.loads(out.read_text())
    assert doc["provenance"]["vllm"] == vllm.__version__ and doc["provenance"]["connector"] is None
    kinds = {op["op"] for op in doc["ops"]}
    assert {"add_request", "lookup", "allocate", "commit", "append_output", "drain_copies",
            "release_retained", "drain_offloads", "free", "pool_state"} <= kinds
    # Sub-block hits happened (h=4 < block 16) and were replayed exactly.
    assert any(op["op"] == "lookup" and op["expect"]["hit"] % 16 for op in doc["ops"])


@pytest.mark.parametrize(("workload", "connector"), [
    ("preemption", "none"), ("store_failures", "tailproof"), ("two_workers", "tailproof"),
    ("chat", "mooncake")])
def test_capture_is_deterministic_and_matches_the_corpus(tmp_path: Path, workload: str,
                                                         connector: str) -> None:
    out = tmp_path / "c.json"
    res = capture(workload, out, geometry="fa16-m16-h4", redact=True, connector=connector)
    assert res.unmodelled == {}  # reservations and landed loads are ops of their own
    suffix = "_mooncake" if connector == "mooncake" else ""
    _same_capture(out, CASES_DIR / f"cap_{workload}_fa16-m16-h4{suffix}.json")
    if connector != "none":  # the connector ran: its ops, store refusals where scripted
        doc = json.loads(out.read_text())
        assert doc["config"]["connector"]["num_workers"] == (2 if workload == "two_workers"
                                                             else 1)
        ops = doc["ops"]
        assert len(ops) >= 500
        assert any(op["op"] == "sched_lookup" and op["expect"]["ext"] for op in ops)
        script = {e for op in ops if op["op"] == "worker_run" for e in op.get("store", [])}
        assert script == ({"ok", "full", "error", "raise"} if workload == "store_failures"
                          else set())


def _same_capture(out: Path, corpus: Path) -> None:
    """``out`` is the corpus capture: byte for byte on the release it was captured on; on the
    other supported release, the same trace but for the release its provenance, config and
    description name (the workloads' ops are the same on 0.33 and 0.34)."""
    if json.loads(corpus.read_text())["provenance"]["vllm"] == vllm.__version__:
        assert out.read_text() == corpus.read_text()
        return
    got, want = json.loads(out.read_text()), json.loads(corpus.read_text())
    assert got["provenance"].pop("vllm") == vllm.__version__
    # the release whose semantics the trace has (config.vllm, absent for 0.33: docs/releases.md)
    assert got["config"].pop("vllm", "0.33") == ".".join(vllm.__version__.split(".")[:2])
    assert want["config"].pop("vllm", "0.33") != ".".join(vllm.__version__.split(".")[:2])
    old, new = want["provenance"].pop("vllm"), vllm.__version__
    want["description"] = want["description"].replace(
        f"vLLM {old.rsplit('.', 1)[0]}'s", f"vLLM {new.rsplit('.', 1)[0]}'s")
    assert got == want


def test_redaction_keeps_every_observation(tmp_path: Path) -> None:
    plain, red = tmp_path / "plain.json", tmp_path / "red.json"
    capture("agent", plain, seed=3)
    capture("agent", red, seed=3, redact=True)
    a, b = json.loads(plain.read_text()), json.loads(red.read_text())
    assert b["provenance"]["redacted"] is True
    assert [op.get("expect") for op in a["ops"]] == [op.get("expect") for op in b["ops"]]
    ta, tb = load_trace(plain), load_trace(red)
    prompts_a = [op["tokens"] for op in ta.ops if op["op"] == "add_request"]
    prompts_b = [op["tokens"] for op in tb.ops if op["op"] == "add_request"]
    assert [len(p) for p in prompts_a] == [len(p) for p in prompts_b]
    # The first prompt is all fresh context: canonical ids 0, 1, 2, ... -- no token id of the
    # original survives, only which positions are equal.
    assert prompts_b[0] == list(range(len(prompts_b[0]))) != prompts_a[0]
    assert run_trace(tb, ["reference", "vllm"], strict=True).divergences == []
    assert len(red.read_text()) < len(plain.read_text())  # fresh ids compress to ranges


def test_rotation_segments_join_back(tmp_path: Path) -> None:
    out = tmp_path / "rot.json"
    whole = tmp_path / "whole.json"
    res = capture("aborts", out, max_bytes=20_000)
    capture("aborts", whole)
    parts = sorted(tmp_path.glob("rot*.json"))
    assert len(parts) >= 3 and res.path == out
    for p in parts:
        json.loads(p.read_text())  # every segment is a complete JSON document
        assert p.stat().st_size < 40_000
    doc = join_segments([out] + [p for p in parts if p != out])
    assert doc["ops"] == json.loads(whole.read_text())["ops"]
    assert run_trace(parse_trace(doc), ["reference", "vllm"], strict=True).divergences == []


def test_capture_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "--workload", "nope", "-o", str(tmp_path / "x.json")]) == 2
    assert "--workload: unknown workload 'nope'" in capsys.readouterr().err
    with pytest.raises(CaptureError, match="--connector: 'lmcache' is not supported"):
        capture("chat", tmp_path / "x.json", connector="lmcache")
    assert main(["capture", "--workload", "two_workers", "-o", str(tmp_path / "x.json")]) == 2
    assert "pass --connector tailproof" in capsys.readouterr().err
    assert main(["capture", "--workload", "resend", "--connector", "mooncake",
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "cannot run with mooncake" in capsys.readouterr().err


def test_connector_capture_of_a_core_workload_replays(tmp_path: Path) -> None:
    # conn_finish includes the remove_skipped_blocks of Scheduler._connector_finished: read
    # before it, its free was one block short on chat and the models diverged there.
    out = tmp_path / "chat_conn.json"
    res = capture("chat", out, connector="tailproof")
    assert "remove_skipped_blocks" not in res.unmodelled and res.ops >= 500
    result = run_trace(load_trace(out), ["reference", "impl"], strict=True)
    assert result.divergences == []


@pytest.mark.slow
def test_reset_with_running_requests_under_the_connector_replays(tmp_path: Path) -> None:
    """``resend`` with the connector: ``reset_prefix_cache(reset_running_requests=True)``
    preempts requests that the next step re-admits with store loads and reports preempted in
    the same output; the loads are issued and the trace replays op-exactly on all three."""
    out = tmp_path / "resend_conn.json"
    capture("resend", out, connector="tailproof")
    ops = load_trace(out).ops
    step = next(i for i, o in enumerate(ops) if o["op"] == "conn_step" and o["preempted"])
    ready = {o["rid"] for o in ops[step:] if o["op"] == "remote_kv_ready"}
    assert set(ops[step]["preempted"]) <= ready  # every re-admitted request's load landed
    result = run_trace(load_trace(out), ["reference", "impl", "vllm"], strict=True)
    assert result.divergences == []


def test_mooncake_store_connector_is_recorded_like_ours(tmp_path: Path) -> None:
    # vLLM's own MooncakeStoreConnector (scheduler side, and each rank's sending thread over
    # the embedded store) under the store_failures workload: its lookups, jobs, finishes,
    # scripted refusals, reports and landed loads are recorded, and the op stream equals
    # the one TailproofConnector produced for the same workload (the corpus capture).
    out = tmp_path / "m.json"
    res = capture("store_failures", out, geometry="fa16-m16-h4", redact=True,
                  connector="mooncake")
    assert res.unmodelled == {}
    doc = json.loads(out.read_text())
    assert doc["provenance"]["connector"] == "MooncakeStoreConnector"
    assert "MooncakeStoreConnector" in doc["description"]
    ours = json.loads((CASES_DIR / "cap_store_failures_fa16-m16-h4.json").read_text())
    assert ours["provenance"]["connector"] == "TailproofConnector"
    doc["config"].pop("vllm", None)  # the release a 0.34 capture names (docs/releases.md)
    assert doc["config"] == ours["config"] and doc["ops"] == ours["ops"]
    kinds = {op["op"] for op in doc["ops"]}
    assert {"sched_lookup", "conn_step", "conn_finish", "worker_run", "worker_report",
            "remote_kv_ready"} <= kinds
    assert any(op["op"] == "allocate" and op.get("reserved") for op in doc["ops"])
    script = {e for op in doc["ops"] if op["op"] == "worker_run" for e in op.get("store", [])}
    assert script == {"full", "error", "raise"} | ({"ok"} & script)
