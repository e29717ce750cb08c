"""The historical-bug corpus: every upstream bug has a checked status per release; each fixed
one's mutant is killed by its named case alone; each present one is a finding of check/replay
(never a failure), and where TailproofConnector avoids it the difference shows side by side.
The checks run on the installed release's column (``make test`` runs both releases)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (0.33 or 0.34) is not installed in this environment")
pytestmark = pytest.mark.vllm

from tailproof.conformance.cli.main import main  # noqa: E402
from tailproof.conformance.format.trace import load_trace, parse_trace  # noqa: E402
from tailproof.conformance.harness.corpus import CASES_DIR  # noqa: E402
from tailproof.conformance.harness.releases import installed_release  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402
from tailproof.conformance.tools.history import findings as hf  # noqa: E402
from tailproof.conformance.tools.history.bugs import (  # noqa: E402
    BUGS,
    FIXED,
    FOUND_HERE,
    PRESENT,
    RELEASES,
    STATUSES,
    by_ref,
)
from tailproof.conformance.tools.history.verify import case_ops, verify_bug  # noqa: E402
from tailproof.conformance.tools.mutate.catalog import MUTANTS  # noqa: E402

#: The release whose column the checks run on.
INSTALLED = installed_release()
#: The bugs issue 21 lists, in its order.
ISSUE_21 = ["vllm#49502", "vllm#52832", "vllm#51358", "vllm#50359", "vllm#51766", "vllm#43559",
            "vllm#46453", "vllm#54360", "LMCache#4247", "Mooncake#2827", "vllm#56615",
            "vllm#56972", "vllm#56971", "vllm#45238", "vllm#56142", "vllm#49250",
            "vllm#45497", "vllm#53730", "vllm#57596"]
CATALOG = {m.id: m for m in MUTANTS}


def test_every_listed_bug_has_one_checked_entry() -> None:
    assert [b.ref for b in BUGS if b.listed != FOUND_HERE] == ISSUE_21
    for b in BUGS:
        assert [c.release for c in b.later] == sorted({c.release for c in b.later},
                                                      key=RELEASES.index), b.ref
        for rel in RELEASES:
            e = b.at(rel)
            assert e.status in STATUSES and e.reason and e.statement and e.touches, (b.ref, rel)
            if e.status == FIXED:
                assert e.mutants and e.case and case_ops(e.case), (b.ref, rel)
                assert all(CATALOG[m].release in (None, rel) for m in e.mutants), (b.ref, rel)
            if e.status == PRESENT and e.finding:
                assert (e.finding in hf.TRACE_DETECTORS or e.finding in hf.STATIC_DETECTORS
                        or e.finding in hf.ENGINE_DETECTORS), (b.ref, rel)


def test_fixed_bugs_cases_are_named_after_them_and_small() -> None:
    """Each bug fixed in a release, in that release's column: a hist_<number>_ case of at
    most 20 ops, and every mutant of it carries the upstream reference."""
    for b in BUGS:
        for rel in RELEASES:
            e = b.at(rel)
            if e.status != FIXED:
                continue
            assert e.case and e.case.startswith(f"hist_{b.number}_"), (b.ref, rel)
            assert (case_ops(e.case) or 99) <= 20, (b.ref, rel, case_ops(e.case))
            assert all(b.number in (CATALOG[m].upstream or "") for m in e.mutants), (b.ref, rel)


@pytest.mark.parametrize("ref", [b.ref for b in BUGS if b.at(INSTALLED).status == FIXED])
def test_named_case_alone_kills_the_mutants(ref: str) -> None:
    res = verify_bug(by_ref(ref).at(INSTALLED))
    assert res and all(r["killed"] for r in res.values()), res


def _no_expect(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for op in doc["ops"]:
        op.pop("expect", None)
    return doc


#: vLLM #56972, per release: (case, the op of the decode-time conn_step, does vLLM's
#: connector put the Mamba state at 16?). 0.33 drops it (present, a finding); 0.34 stores it
#: with save_decode_cache (fixed).
CASE_56972 = {"0.33": ("hist_56972_decode_mamba_state_not_stored", 23, False),
              "0.34": ("hist_56972_decode_checkpoint_stored_v034", 14, True)}


def _puts_decode_state(obs: dict) -> bool:
    return any(p["boundary"] == 16 and p["group"] == 1 for j in obs["jobs"] for p in j["puts"])


def test_56972_side_by_side() -> None:
    """vLLM's connector, on the installed release: 0.33 drops the decode-phase Mamba state (a
    finding), 0.34 puts it (no finding). TailproofConnector with decode_boundary_saves puts
    it on the same ops either way."""
    name, at, stored = CASE_56972[INSTALLED]
    doc = json.loads((CASES_DIR / f"{name}.json").read_text())
    vllm_run = run_trace(load_trace(CASES_DIR / f"{name}.json"),
                         ["reference", "vllm-mooncake"], True)
    assert not vllm_run.divergences and not vllm_run.refused
    assert _puts_decode_state(vllm_run.observations["vllm-mooncake"][at]) is stored
    found = hf.trace_findings([vllm_run])
    if stored:
        assert found == []
    else:
        assert [f["bug"] for f in found] == ["vllm#56972"]
        assert found[0]["adapter"] == "vllm-mooncake" and found[0]["op_index"] == at
    ext = _no_expect(doc)
    ext["config"]["connector"]["decode_boundary_saves"] = True
    impl_run = run_trace(parse_trace(ext, "<x07-style>"), ["reference", "impl"], True)
    assert not impl_run.divergences and not impl_run.refused
    assert _puts_decode_state(impl_run.observations["impl"][at])
    assert hf.trace_findings([impl_run]) == []  # the reference here models the extension


def test_56971_finding_is_static() -> None:
    (f,) = [f for f in hf.static_findings() if f["bug"] == "vllm#56971"]
    assert f["result"] == "counterexample" and "KeyMetadata" in f["message"]


#: Per release, a case showing a present bug's finding: (case, adapters, bugs found).
FINDING_CASE = {
    "0.33": ("hist_56972_decode_mamba_state_not_stored", "reference,vllm-mooncake",
             ["vllm#56972"]),
    "0.34": ("hist_56142_shared_prefix_checkpoint_past_a_group", "reference,vllm-mooncake",
             ["vllm#56142"]),
}


def _replay_json(capsys: pytest.CaptureFixture[str], case: str, against: str) -> dict:
    assert main(["replay", str(CASES_DIR / f"{case}.json"), "--against", against,
                 "--strict-ids", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_lists_findings_without_changing_the_exit_status(
        capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    case, against, bugs = FINDING_CASE[INSTALLED]
    doc = _replay_json(capsys, case, against)
    assert doc["result"] == "agreed" and doc["exit_code"] == 0
    assert [f["bug"] for f in doc["findings"]] == bugs
    schema = json.loads((CASES_DIR.parent / "schema" / "report.schema.json").read_text())
    jsonschema.validate(doc, schema)
    if INSTALLED == "0.34":  # #56972 is fixed: neither of its cases is a finding there
        for name in ("hist_56972_decode_mamba_state_not_stored",
                     "hist_56972_decode_checkpoint_stored_v034"):
            assert _replay_json(capsys, name, "reference,vllm-mooncake")["findings"] == []


def test_history_json_follows_the_command_schema(capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    rc = main(["history", "--json", "--bug", "49502", "--bug", "vllm#56972",
               "--bug", "46453"])
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, json.loads(
        (CASES_DIR.parent / "schema" / "command.schema.json").read_text()))
    assert rc == 0 and doc["result"] == "covered"
    rows = {r["bug"]: r for r in doc["body"]["bugs"]}
    assert all(r["checked_on"] == INSTALLED for r in rows.values())
    assert rows["vllm#49502"]["mutants"]["m-49502-tail-only-on-cow"]["killed"] is True
    r56972 = rows["vllm#56972"]
    assert {rel: c["status"] for rel, c in r56972["releases"].items()} == {
        "0.33": PRESENT, "0.34": FIXED}
    if INSTALLED == "0.33":
        assert r56972["status"] == PRESENT and r56972["reported"] is True
    else:
        assert r56972["status"] == FIXED and "reported" not in r56972
        assert r56972["case"] == "hist_56972_decode_checkpoint_stored_v034"
        assert r56972["mutants"]["ms-034-56972-decode-checkpoint-dropped"]["killed"] is True
    assert rows["vllm#46453"]["status"] == "not_applicable"


#: The forced-preemption hang of docs/triage.md on vLLM's own connector, per release: the
#: variants in which the re-admitted request is never served.
FORCED_PREEMPTION = {
    "0.33": ["asynchronous load: WAITING_FOR_REMOTE_KVS after 30 steps (no load issued)",
             "synchronous load, Model Runner V1: TypeError in "
             "MooncakeStoreScheduler.build_connector_meta",
             "synchronous load, Model Runner V2: AssertionError in "
             "MooncakeStoreScheduler.build_connector_meta"],
    "0.34": ["asynchronous load: WAITING_FOR_REMOTE_KVS after 30 steps (no load issued)",
             "synchronous load, Model Runner V2: AssertionError in "
             "MooncakeStoreScheduler.build_connector_meta"],
}


def test_forced_preemption_hangs_or_crashes_per_release() -> None:
    """vLLM's Scheduler and MooncakeStoreConnector (the capture engine): a request re-admitted
    after reset_prefix_cache(reset_running_requests=True) is never served, on either release
    (history entry tailproof#forced-preemption, present on both)."""
    assert all(by_ref("forced-preemption").at(rel).status == PRESENT for rel in RELEASES)
    f = hf.engine_finding("forced_preemption_stalls")
    assert f is not None and f["bug"] == "tailproof#forced-preemption"
    assert f["message"].split("; ") == FORCED_PREEMPTION[INSTALLED]


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
    """``check --json`` (the whole corpus) reports each bug present in the installed release
    once (engine findings are ``history``'s only), exit status 0."""
    assert main(["check", "--no-prove", "--adapters", "reference", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "agreed"
    present = sorted(b.ref for b in BUGS if b.at(INSTALLED).status == PRESENT
                     and b.at(INSTALLED).finding not in hf.ENGINE_DETECTORS)
    assert sorted(f["bug"] for f in doc["findings"] if f.get("source") == "history") == present
