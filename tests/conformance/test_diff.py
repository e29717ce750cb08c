"""``tailproof diff``: the same ops on two installed vLLM releases, each in a process of its
own; every change is found at its first differing op, shrunk, and explained by a documented
rule change (docs/releases.md) or a fixed upstream bug (docs/history.md), else exit 1.

The explanation is checked on the reference alone (no vLLM); the end-to-end runs need both
supported releases installed (``scripts/bootstrap.sh``) and run under either one."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.corpus import CASES_DIR
from tailproof.conformance.tools.diff.explain import (
    FIXED_BUG,
    RULE_CHANGE,
    SWITCHES,
    UNEXPLAINED,
    explain,
    reference_stream,
)
from tailproof.conformance.tools.diff.run import first_difference
from tailproof.conformance.tools.diff.sides import VLLM_ENV, child_pythonpath
from tailproof.reference.releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((CASES_DIR.parent / "schema" / "command.schema.json").read_text())

#: One case per documented switch (and the fixed bug), the explanation expected for it.
BY_RULE = {
    "core_c54_lookup_bound_taken_as_given": (RULE_CHANGE, ["clamp_lookup_bound"], None),
    "conn_refuses_foreign_handoffs": (RULE_CHANGE, ["preempted_tracker_dropped"], None),
    "conn_v034_missing_source_retried": (RULE_CHANGE, ["monotone_saved_offset"], None),
    "conn_v034_resumed_before_running": (RULE_CHANGE, ["resumed_as_new"], None),
    "hist_56972_decode_checkpoint_stored_v034": (FIXED_BUG, ["decode_checkpoints"],
                                                 "vllm#56972"),
}


def _installed(release: str) -> bool:
    res = subprocess.run([str(VLLM_ENV), release], capture_output=True, cwd=ROOT, check=False)
    return res.returncode == 0


def _needs_both() -> None:
    missing = [r for r in RELEASES if not _installed(r)]
    if missing:
        pytest.skip(f"vLLM {', '.join(missing)} not installed (scripts/bootstrap.sh)")
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")


@pytest.mark.parametrize("case", sorted(BY_RULE))
def test_each_documented_change_is_explained_on_the_reference(case: str) -> None:
    """The classifier alone: the reference's 0.33 and 0.34 streams stand in for the two
    vLLMs (they are what the corpus shows vLLM does), and each case's change is put down to
    its switch (and #56972 to the bug whose detector fires on 0.33 only)."""
    trace = load_trace(CASES_DIR / f"{case}.json")
    a, b = reference_stream(trace, "0.33"), reference_stream(trace, "0.34")
    at = first_difference(a, b)
    assert at is not None
    why = explain(trace, at, a, b, "0.33", "0.34")
    kind, switches, bug = BY_RULE[case]
    assert (why.kind, why.switches, why.bug) == (kind, switches, bug), why.reason


def test_every_switch_has_a_case() -> None:
    assert sorted(s for k, ss, _ in BY_RULE.values() for s in ss) == sorted(SWITCHES)


def test_a_change_no_switch_accounts_for_is_unexplained(monkeypatch: pytest.MonkeyPatch,
                                                        ) -> None:
    trace = load_trace(CASES_DIR / "core_c54_lookup_bound_taken_as_given.json")
    a, b = reference_stream(trace, "0.33"), reference_stream(trace, "0.34")
    at = first_difference(a, b)
    assert at is not None
    monkeypatch.setitem(RELEASES, "0.34", replace(RELEASES["0.34"], clamp_lookup_bound=False))
    why = explain(trace, at, a, b, "0.33", "0.34")
    assert why.kind == UNEXPLAINED and "does not follow" in why.reason


def test_child_pythonpath_keeps_only_this_sides_vllm(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "overlay"
    (other / "vllm").mkdir(parents=True)
    (other / "vllm" / "__init__.py").write_text("")
    mine = tmp_path / "mine"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(other), "/x/lib"]))
    assert child_pythonpath(str(mine)) == os.pathsep.join([str(mine), "/x/lib"])
    assert child_pythonpath(None) == "/x/lib"


@pytest.mark.parametrize("argv, words", [
    (["--from", "0.35"], "not a release tailproof follows"),
    (["--from", "0.34", "--to", "0.34"], "the same vLLM"),
    (["--to", "0.34=/no/such/folder"], "holds no vllm package"),
    (["--adapters", "reference"], "does not run vLLM"),
])
def test_bad_sides_exit_2_one_line(argv: list[str], words: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.vllm
def test_033_to_034_every_change_explained_json_and_junit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own code on both releases: the documented cases change, each as its switch
    says, shrunk to a trace that still differs; an unchanged case and an extension case
    (not in vLLM: not compared) come out as such. One JSON document, schema-valid. Then the
    shrunk clamp trace, diffed with 0.34 read as if it did not clamp lookup bounds: the same
    change, now unexplained, exit 1."""
    _needs_both()
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    cases = [*BY_RULE, "core_c01_producer_subblock_tail", "conn_x01_two_turn_chat_resumes_past_"
             "response"]
    junit = tmp_path / "diff.xml"
    rc = main(["diff", *(str(CASES_DIR / f"{c}.json") for c in cases), "--json",
               "--junit", str(junit)])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert rc == 0 and doc["exit_code"] == 0 and doc["result"] == "explained"
    body = doc["body"]
    assert (body["from"]["release"], body["to"]["release"]) == ("0.33", "0.34")
    assert body["from"]["vllm"].startswith("0.33.") and body["to"]["vllm"].startswith("0.34.")
    got = {c["trace"]: (c["kind"], c["switches"], c["bug"]) for c in body["changes"]}
    assert got == BY_RULE
    assert body["counts"] == {"rule_change": 4, "fixed_bug": 1, "unexplained": 0}
    assert body["unchanged"] == 1 and list(body["not_compared"]) == [cases[-1]]
    for c in body["changes"]:
        assert c["ops_after"] < c["ops_before"] and c["before"] != c["after"]
        assert c["shrunk"]["config"]["groups"] and len(c["shrunk"]["ops"]) == c["ops_after"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == str(len(cases))
    assert suite.get("failures") == "0" and suite.get("skipped") == "1"

    small = next(c for c in body["changes"]
                 if c["trace"] == "core_c54_lookup_bound_taken_as_given")
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small["shrunk"]))
    monkeypatch.setitem(RELEASES, "0.34", replace(RELEASES["0.34"], clamp_lookup_bound=False))
    assert main(["diff", str(path), "--json"]) == 1
    again = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator(SCHEMA).validate(again)
    assert again["exit_code"] == 1 and again["result"] == "unexplained"
    assert [(c["op_index"], c["kind"]) for c in again["body"]["changes"]] == [
        (small["shrunk_op_index"], UNEXPLAINED)]
