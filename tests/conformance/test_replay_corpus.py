"""The shipped corpus replays on vLLM 0.33 (strict ids) exactly as its recorded expectations,
and ``--json`` reports what a CI job needs."""

from __future__ import annotations

import json

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.harness.corpus import corpus_paths

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")


def _core_cases() -> list[str]:
    return [str(p) for p in corpus_paths() if p.name.startswith("core_")]


def test_corpus_has_at_least_30_core_cases() -> None:
    assert len(_core_cases()) >= 30


def test_core_corpus_matches_vllm_strict(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", *_core_cases(), "--against", "vllm", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert rc == 0
    assert out["cases"] == len(_core_cases())
    assert out["ops"] > 500
    assert {"cases", "ops", "divergences", "seconds", "skipped_ops"} <= set(out)


def test_tampered_expectation_is_reported_at_its_op(tmp_path, capsys) -> None:
    src = json.loads(open(_core_cases()[0]).read())
    idx = next(i for i, op in enumerate(src["ops"]) if op["op"] == "allocate")
    src["ops"][idx]["expect"]["new"][0][0] += 100
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(src))
    rc = main(["replay", str(path), "--against", "vllm", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    (d,) = out["divergences"]
    assert (d["op_index"], d["adapter"], d["against"]) == (idx, "vllm", "expected")
    rc = main(["replay", str(path), "--against", "vllm", "--strict-ids"])
    text = capsys.readouterr().out
    assert f"at op {idx} (allocate)" in text and ">>" in text
