"""Teeth for the differential runner: change one rule of the reference model and replay must
report a divergence at the first op whose observation the rule affects."""

from __future__ import annotations

import json

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.harness.corpus import CASES_DIR
from tailproof.reference import managers

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

CASE = CASES_DIR / "core_c01_producer_subblock_tail.json"


def _free_not_reversed(self, request_id: str) -> None:  # noqa: ANN001
    self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))


def test_free_without_reversal_diverges_at_the_next_snapshot(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ops = json.loads(CASE.read_text())["ops"]
    first_free = next(i for i, op in enumerate(ops) if op["op"] == "free")
    # free itself observes only the free count; the order shows in the next snapshot.
    want = next(i for i in range(first_free, len(ops)) if ops[i]["op"] == "pool_state")

    assert main(["replay", str(CASE), "--against", "reference,vllm", "--strict-ids"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(managers.FullAttentionManager, "free", _free_not_reversed)
    rc = main(["replay", str(CASE), "--against", "reference,vllm", "--strict-ids", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    by_against = {d["against"]: d for d in out["divergences"]}
    assert by_against["expected"]["adapter"] == "reference"
    assert by_against["expected"]["op_index"] == want
    assert by_against["expected"]["got"]["free_queue"] != by_against["expected"]["expected"][
        "free_queue"]
    # vLLM itself still matches the recorded expectations.
    assert all(d["adapter"] == "reference" or d["against"] == "reference"
               for d in out["divergences"])
