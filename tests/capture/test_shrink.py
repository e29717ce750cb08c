"""``tailproof shrink``: a divergence seeded into a captured trace of >= 1,000 ops (an adapter
whose lookups drop sub-block hits) shrinks to <= 20 ops with the same divergence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.adapters import ADAPTERS, AdapterSpec
from tailproof.conformance.harness.adapters.reference_core import ReferenceCoreBackend
from tailproof.conformance.harness.corpus import CASES_DIR
from tailproof.conformance.harness.replay import run_trace
from tailproof.conformance.tools.shrink import shrink

MIXED = CASES_DIR / "cap_mixed_fa16-m16-h4.json"


class LookupDropsSubBlockHits(ReferenceCoreBackend):
    """The reference model with a planted bug: a prefix hit is rounded down to whole
    scheduler blocks (as if partial hits were off), the blocks left untouched."""

    def lookup(self, rid: str, max_len: int | None) -> tuple[int, list[list[int]]]:
        hit, blocks = super().lookup(rid, max_len)
        return hit - hit % self.config.scheduler_block_size, blocks


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(ADAPTERS, "broken", AdapterSpec(
        "broken", f"{__name__}:LookupDropsSubBlockHits", None, "planted lookup bug"))
    return "broken"


def test_shrink_seeded_divergence_to_20_ops(broken: str) -> None:
    trace = load_trace(MIXED)
    assert len(trace.ops) >= 1000
    assert run_trace(trace, ["reference", "vllm"], strict=True).divergences == []
    res = shrink(trace, ["reference", broken], strict=True)
    assert res.signature == (broken, "reference", "lookup", "hit")
    assert res.ops_before == len(trace.ops) and res.ops_after <= 20
    small = run_trace(load_trace_doc(res.doc), ["reference", broken], strict=True)
    d = small.divergences[0]
    assert (d.op, d.adapter) == ("lookup", broken)
    assert run_trace(load_trace_doc(res.doc), ["reference", "vllm"], strict=True).divergences == []


def load_trace_doc(doc: dict) -> object:
    from tailproof.conformance.format.trace import parse_trace

    return parse_trace(json.loads(json.dumps(doc)), "<shrunk>")


def test_shrink_cli_writes_file_and_sizes(broken: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "small.json"
    rc = main(["shrink", str(MIXED), "--against", f"reference,{broken}", "--strict-ids",
               "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out  # the summary line; the trace itself went to -o
    assert f"{len(load_trace(MIXED).ops)} ops ->" in text
    assert len(load_trace(out).ops) <= 20


def test_shrink_json_follows_the_command_schema(broken: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    from tailproof.conformance.harness.corpus import CASES_DIR as cases

    rc = main(["shrink", str(MIXED), "--against", f"reference,{broken}", "--strict-ids",
               "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    schema = json.loads((cases.parent / "schema" / "command.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert doc["command"] == "shrink" and doc["body"]["ops_after"] <= 20
    assert len(load_trace_doc(doc["body"]["trace"]).ops) == doc["body"]["ops_after"]


def test_shrink_without_divergence_is_bad_input(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    case = CASES_DIR / "cap_chat_fa16-m16-h4.json"
    assert main(["shrink", str(case), "--against", "reference", "-o",
                 str(tmp_path / "x.json")]) == 2
    assert "no divergence" in capsys.readouterr().err
