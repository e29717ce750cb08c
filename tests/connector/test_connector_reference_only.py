"""The reference connector alone (no vLLM needed) reproduces every recorded expectation of the
connector corpus, block ids included."""

from __future__ import annotations

import json

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.harness.corpus import corpus_paths


def test_reference_matches_recorded_vllm_observations(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [str(p) for p in corpus_paths() if p.name.startswith("conn_")]
    assert len(cases) >= 20
    rc = main(["replay", *cases, "--against", "reference", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert out["skipped_ops"] == {}
    assert rc == 0
