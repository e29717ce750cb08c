"""The connector corpus: enough cases, each described, and replaying with no divergence on the
reference, vLLM 0.33 core only, and vLLM 0.33 + Mooncake (against the recorded expectations)."""

from __future__ import annotations

import json

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.ops import CONNECTOR_OP_SPECS
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.releases import ReleaseGate

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")


def _conn_cases() -> list[str]:
    return [str(p) for p in corpus_paths() if p.name.startswith("conn_")]


def test_at_least_20_described_connector_cases() -> None:
    cases = _conn_cases()
    assert len(cases) >= 20
    for path in cases:
        doc = json.loads(open(path).read())
        assert len(doc["description"]) > 80, path
        assert any(op["op"].startswith(("conn_", "worker_", "store_", "sched_"))
                   for op in doc["ops"]), path
        assert all("expect" in op for op in doc["ops"]), path


def test_connector_corpus_replays_without_divergence(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", *_conn_cases(), "--against", "reference,vllm,vllm-mooncake", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert rc == 0
    # the core-only adapter skips connector ops (and is not observed after the first one);
    # both vLLM adapters refuse the extension's cases, saying why
    assert set(out["skipped_ops"]) == {"vllm", "vllm-mooncake"}
    for name, s in out["skipped_ops"]["vllm"].items():
        if name in _extension_cases() | _pin_rule_cases():
            assert any(k in s["refused"] for k in (
                "turn_end_checkpoints", "decode_boundary", "junction_checkpoints",
                "readable_pins", "pin_budget_fraction")), s
            continue
        assert set(s["unsupported_ops"]) <= set(CONNECTOR_OP_SPECS) and s["unsupported_ops"]
        assert s["unobserved_ops"] > 0 and "refused" not in s
    refused = out["skipped_ops"]["vllm-mooncake"]
    other = _other_release_cases("vllm-mooncake")
    assert set(refused) == _extension_cases() | _pin_rule_cases() | other
    assert all("not in vLLM 0.33 or 0.34" in s["refused"] or name in other
               for name, s in refused.items())
    assert all("config.vllm is" in refused[name]["refused"] for name in other)


def _other_release_cases(adapter: str) -> set[str]:
    """The connector cases of the other vLLM release that the installed one disagrees on
    (``ReleaseGate``, docs/releases.md): the vLLM-backed adapters refuse them."""
    skip = _extension_cases() | _pin_rule_cases()  # refused for their settings first
    traces = [load_trace(p) for p in _conn_cases()]
    return {t.name for t in traces
            if t.name not in skip and ReleaseGate(t).refusal(adapter) is not None}


def _extension_cases() -> set[str]:
    """The turn-end checkpoint extension's cases
    (``conformance/tools/authoring/reuse_cases.py``)."""
    return {p.stem for p in corpus_paths() if p.name.startswith("conn_x")}


def _pin_rule_cases() -> set[str]:
    """tailproof's pin rules' cases (``conformance/tools/authoring/pins_cases.py``): not in
    vLLM 0.33."""
    return {p.stem for p in corpus_paths() if p.name.startswith("conn_rp")}


def test_pin_rule_cases_replay_on_reference_and_impl_strict(
        capsys: pytest.CaptureFixture[str]) -> None:
    cases = sorted(str(p) for p in corpus_paths() if p.stem in _pin_rule_cases())
    assert len(cases) >= 4
    rc = main(["replay", *cases, "--against", "reference,impl", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert out["skipped_ops"] == {}
    assert rc == 0


def test_extension_cases_replay_on_reference_and_impl_strict(
        capsys: pytest.CaptureFixture[str]) -> None:
    cases = sorted(str(p) for p in corpus_paths() if p.stem in _extension_cases())
    assert len(cases) >= 9
    rc = main(["replay", *cases, "--against", "reference,impl", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    # impl runs the installed release: it refuses only the other release's cases it differs on
    refused = out["skipped_ops"].get("impl", {})
    assert set(refused) == {t.name for t in map(load_trace, cases)
                            if ReleaseGate(t).refusal("impl") is not None}
    assert set(out["skipped_ops"]) <= {"impl"}
    assert rc == 0


def test_connector_corpus_strict_ids_reference_vs_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", *_conn_cases(), "--against", "vllm-mooncake,reference",
               "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert rc == 0
