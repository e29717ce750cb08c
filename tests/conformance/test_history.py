"""The historical-bug corpus: every upstream bug has a checked status; each fixed one's mutant
is killed by its named case alone; each present one is a finding of check/replay (never a
failure), and where TailproofConnector avoids it the difference shows side by side."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")
pytestmark = pytest.mark.vllm

from tailproof.conformance.cli.main import main  # noqa: E402
from tailproof.conformance.format.trace import load_trace, parse_trace  # noqa: E402
from tailproof.conformance.harness.corpus import CASES_DIR  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402
from tailproof.conformance.tools.history import findings as hf  # noqa: E402
from tailproof.conformance.tools.history.bugs import (  # noqa: E402
    BUGS,
    FIXED,
    PRESENT,
    STATUSES,
    by_ref,
)
from tailproof.conformance.tools.history.verify import case_ops, verify_bug  # noqa: E402
from tailproof.conformance.tools.mutate.catalog import MUTANTS  # noqa: E402

#: The bugs issue 21 lists, in its order.
ISSUE_21 = ["vllm#49502", "vllm#52832", "vllm#51358", "vllm#50359", "vllm#51766", "vllm#43559",
            "vllm#46453", "vllm#54360", "LMCache#4247", "Mooncake#2827", "vllm#56615",
            "vllm#56972", "vllm#56971", "vllm#45238", "vllm#56142", "vllm#49250",
            "vllm#45497", "vllm#53730", "vllm#57596"]
CATALOG = {m.id: m for m in MUTANTS}


def test_every_listed_bug_has_one_checked_entry() -> None:
    assert [b.ref for b in BUGS] == ISSUE_21
    for b in BUGS:
        assert b.status in STATUSES and b.reason and b.statement and b.touches, b.ref
        if b.status == FIXED:
            assert b.mutants and b.case and case_ops(b.case), b.ref
            assert all(m in CATALOG for m in b.mutants), b.ref
        if b.status == PRESENT and b.finding:
            assert b.finding in hf.TRACE_DETECTORS or b.finding in hf.STATIC_DETECTORS


def test_fixed_bugs_cases_are_named_after_them_and_small() -> None:
    """Each bug the issue lists as fixed upstream and 0.33 has fixed: a hist_<number>_ case
    of at most 20 ops, and every mutant of it carries the upstream reference."""
    for b in BUGS:
        if b.listed == "fixed upstream" and b.status == FIXED:
            assert b.case and b.case.startswith(f"hist_{b.number}_"), b.ref
            assert (case_ops(b.case) or 99) <= 20, b.ref
            assert all(b.number in (CATALOG[m].upstream or "") for m in b.mutants), b.ref


@pytest.mark.parametrize("ref", [b.ref for b in BUGS if b.status == FIXED
                                 and b.listed == "fixed upstream"])
def test_named_case_alone_kills_the_mutants(ref: str) -> None:
    res = verify_bug(by_ref(ref))
    assert res and all(r["killed"] for r in res.values()), res


def _no_expect(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for op in doc["ops"]:
        op.pop("expect", None)
    return doc


def test_56972_side_by_side() -> None:
    """vLLM's connector drops the decode-phase Mamba state (a finding); TailproofConnector
    with decode_boundary_saves puts it, on the same ops."""
    doc = json.loads((CASES_DIR / "hist_56972_decode_mamba_state_not_stored.json").read_text())
    vllm_run = run_trace(load_trace(CASES_DIR / f"{doc['name']}.json"),
                         ["reference", "vllm-mooncake"], True)
    assert not vllm_run.divergences
    found = hf.trace_findings([vllm_run])
    assert [f["bug"] for f in found] == ["vllm#56972"]
    assert found[0]["adapter"] == "vllm-mooncake" and found[0]["op_index"] == 23
    ext = _no_expect(doc)
    ext["config"]["connector"]["decode_boundary_saves"] = True
    impl_run = run_trace(parse_trace(ext, "<x07-style>"), ["reference", "impl"], True)
    assert not impl_run.divergences
    jobs = impl_run.observations["impl"][23]["jobs"]  # type: ignore[index]
    assert any(p["boundary"] == 16 and p["group"] == 1 for j in jobs for p in j["puts"])
    assert hf.trace_findings([impl_run]) == []  # the reference here models the extension


def test_56971_finding_is_static() -> None:
    (f,) = [f for f in hf.static_findings() if f["bug"] == "vllm#56971"]
    assert f["result"] == "counterexample" and "KeyMetadata" in f["message"]


def test_replay_lists_findings_without_changing_the_exit_status(
        capsys: pytest.CaptureFixture[str]) -> None:
    case = str(CASES_DIR / "hist_56972_decode_mamba_state_not_stored.json")
    assert main(["replay", case, "--against", "reference,vllm-mooncake", "--strict-ids",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "agreed" and doc["exit_code"] == 0
    assert [f["bug"] for f in doc["findings"]] == ["vllm#56972"]
    schema = json.loads((CASES_DIR.parent / "schema" / "report.schema.json").read_text())
    import jsonschema

    jsonschema.validate(doc, schema)


def test_history_json_follows_the_command_schema(capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    rc = main(["history", "--json", "--bug", "49502", "--bug", "vllm#56972",
               "--bug", "46453"])
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, json.loads(
        (CASES_DIR.parent / "schema" / "command.schema.json").read_text()))
    assert rc == 0 and doc["result"] == "covered"
    rows = {r["bug"]: r for r in doc["body"]["bugs"]}
    assert rows["vllm#49502"]["mutants"]["m-49502-tail-only-on-cow"]["killed"] is True
    assert rows["vllm#56972"]["reported"] is True
    assert rows["vllm#46453"]["status"] == "not_applicable"


def test_history_unknown_bug_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--bug", "99999", "--no-mutants"]) == 2
    assert "--bug" in capsys.readouterr().err


def test_history_reports_a_surviving_mutant(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """A named case that no longer kills its mutant turns the row (and the exit) red."""
    from tailproof.conformance.tools.history import verify

    b = by_ref("49502")
    # The 52832 case with its finish op dropped cannot see the finish-time tail at all.
    doc = _no_expect(json.loads((CASES_DIR / f"{b.case}.json").read_text()))
    doc["ops"] = [o for o in doc["ops"] if o["op"] != "conn_finish"]
    (tmp_path / f"{b.case}.json").write_text(json.dumps(doc))
    monkeypatch.setattr(verify, "CASES", tmp_path)
    res = verify.verify_bug(b)
    assert res["m-49502-tail-only-on-cow"]["killed"] is False


def test_56142_junction_past_a_group_is_a_finding_only_on_vllm_behaviour() -> None:
    """vLLM's junction passes the smaller FA group's keys (a finding); the same ops with the
    smaller group's key kept agree at every group, and nothing is reported."""
    path = CASES_DIR / "hist_56142_shared_prefix_checkpoint_past_a_group.json"
    run = run_trace(load_trace(path), ["reference", "vllm"], True)
    assert not run.divergences
    (f,) = hf.trace_findings([run])
    assert f["bug"] == "vllm#56142" and f["op_index"] == 12 and "junction 32" in f["message"]
    doc = _no_expect(json.loads(path.read_text()))
    doc["ops"] = [o for o in doc["ops"] if o["op"] != "evict"]
    kept = run_trace(parse_trace(doc, "<no evict>"), ["reference", "vllm"], True)
    assert not kept.divergences and hf.trace_findings([kept]) == []


def test_56972_needs_decode_saves_on() -> None:
    """Without save_decode_cache no group saves decode blocks: not the bug, no finding."""
    path = CASES_DIR / "hist_56972_decode_mamba_state_not_stored.json"
    doc = _no_expect(json.loads(path.read_text()))
    doc["config"]["connector"]["save_decode_cache"] = False
    run = run_trace(parse_trace(doc, "<no decode saves>"), ["reference", "vllm-mooncake"], True)
    assert not run.divergences and hf.trace_findings([run]) == []


def test_check_lists_every_present_bug_as_a_finding(capsys: pytest.CaptureFixture[str]) -> None:
    """``check --json`` (the whole corpus) reports each present bug once, exit status 0."""
    assert main(["check", "--no-prove", "--adapters", "reference", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "agreed"
    present = sorted(b.ref for b in BUGS if b.status == PRESENT)
    assert sorted(f["bug"] for f in doc["findings"] if f.get("source") == "history") == present
