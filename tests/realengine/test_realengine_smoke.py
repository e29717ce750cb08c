"""``tailproof smoke``: passes on the memory store and on a real Mooncake master, exits 1 naming
the pass when stored values are corrupted, exits 2 on a bad configuration; its ``--json``
stdout is one JSON document (vLLM's log lines, the engine processes' too, go to stderr)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import tailproof.conformance.cli.main as cli
from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import smoke

MEMORY = json.dumps(tb.memory_connector("smoke-test"))


def _smoke(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    rc = cli.main(["smoke", "--kv-transfer-config", *args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else None


@pytest.mark.realengine
@pytest.mark.slow
@pytest.mark.vllm
def test_smoke_passes_on_the_memory_store_and_its_stdout_is_one_json_document() -> None:
    """The command as a user runs it (its own process, vLLM logging at its default level):
    stdout parses as exactly one JSON document, and the engine's log lines are on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    proc = subprocess.run([sys.executable, "-m", "tailproof.conformance.cli.main", "smoke",
                           "--kv-transfer-config", MEMORY, "--json"],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    verdict = json.loads(proc.stdout)  # raises on anything before or after the document
    assert proc.returncode == 0, (verdict, proc.stderr[-2000:])
    assert verdict["ok"] and verdict["failed_pass"] is None
    assert [p["name"] for p in verdict["passes"]] == list(smoke.oracle.PASSES)
    store = next(p for p in verdict["passes"] if p["name"] == "store-hit")
    assert sum(store["cached_tokens"]) > 0
    assert "tailproof-testbed pid=" in proc.stderr  # the bed process's vLLM log lines


def _corrupt(bed: tb.Bed, name: str) -> None:
    assert bed.worker(tb.corrupt_store_values)[0] > 0


@pytest.mark.realengine
@pytest.mark.slow
@pytest.mark.vllm
def test_smoke_names_the_pass_when_stored_values_are_corrupted(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smoke, "PASS_HOOKS", {"store-hit": _corrupt})
    rc, verdict = _smoke(capsys, MEMORY)
    assert rc == 1, verdict
    assert verdict["failed_pass"] == "store-hit"
    store = next(p for p in verdict["passes"] if p["name"] == "store-hit")
    assert any("verify_fail" in k for k in store["load_failures"]), store
    assert any("loads failed" in x for x in store["problems"])


@pytest.mark.realengine
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.mooncake
def test_smoke_passes_on_a_real_mooncake_master(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Any) -> None:
    """The check a deployment runs: the user's Mooncake store (a real master on 127.0.0.1),
    all four passes equal the truth and the store-hit pass is served from the store."""
    from tailproof.conformance.harness.local_master import SLOW_READ_LEASE_TTL_MS, LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"Mooncake client unavailable: {reason}")
    # The engine's Mooncake client (in the bed process, which inherits this environment)
    # listens on loopback only.
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    master = LocalMaster(tmp_path, lease_ttl_ms=SLOW_READ_LEASE_TTL_MS).start()
    try:
        ktc = tb.tailproof_connector({"store": "mooncake", "master_address": master.address,
                                      "namespace": "smoke-mooncake",
                                      "global_segment_size": 64 << 20})
        rc, verdict = _smoke(capsys, json.dumps(ktc))
    finally:
        master.stop()
    assert rc == 0, verdict
    store = next(p for p in verdict["passes"] if p["name"] == "store-hit")
    assert sum(store["cached_tokens"]) > 0 and not store["load_failures"]


@pytest.mark.parametrize("cfg,field", [
    ('{"kv_connector": "MooncakeStoreConnector"}', "kv_connector"),
    ('{"kv_connector": "TailproofConnector", "kv_connector_extra_config": {"bogus": 1}}',
     "bogus"),
    ("[1]", "JSON object"),
    ("{not json", "not JSON"),
    ("@/nonexistent/ktc.json", "cannot read"),
])
def test_smoke_rejects_bad_input(capsys: pytest.CaptureFixture[str], cfg: str,
                                 field: str) -> None:
    pytest.importorskip("vllm")
    rc = cli.main(["smoke", "--kv-transfer-config", cfg])
    err = capsys.readouterr().err
    assert rc == 2
    assert field in err and err.count("\n") == 1 and "(fix: " in err
