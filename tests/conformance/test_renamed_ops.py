"""Op names renamed within trace format 1 (docs/trace-format.md, "Stability"): a trace written
with the old name reads, replays and compares exactly as one written with the new name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tailproof.conformance.format.ops import RENAMED_OPS
from tailproof.conformance.format.trace import TraceError, load_trace, parse_trace
from tailproof.conformance.harness.replay import run_trace

CASE = Path(__file__).resolve().parents[2] / "conformance" / "cases" / \
    "core_c01_producer_subblock_tail.json"


def _with_old_names(doc: dict) -> dict:
    old_of = {new: old for old, new in RENAMED_OPS.items()}
    out = copy.deepcopy(doc)
    for op in out["ops"]:
        op["op"] = old_of.get(op["op"], op["op"])
    return out


def test_the_corpus_case_uses_a_renamed_op() -> None:
    """Not vacuous: the case holds at least one op whose name was renamed."""
    ops = {op["op"] for op in json.loads(CASE.read_text())["ops"]}
    assert ops & set(RENAMED_OPS.values())


def test_old_op_names_read_as_the_new(tmp_path: Path) -> None:
    doc = json.loads(CASE.read_text())
    old = _with_old_names(doc)
    assert any(op["op"] in RENAMED_OPS for op in old["ops"])
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert load_trace(path).ops == parse_trace(doc, str(CASE)).ops


def test_old_op_names_replay_with_the_same_observations(tmp_path: Path) -> None:
    doc = json.loads(CASE.read_text())
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_with_old_names(doc)))
    old_run = run_trace(load_trace(path), ["reference"], strict=True)
    new_run = run_trace(load_trace(CASE), ["reference"], strict=True)
    assert not old_run.divergences and not new_run.divergences
    assert old_run.observations == new_run.observations


def test_unknown_op_names_are_still_refused(tmp_path: Path) -> None:
    doc = json.loads(CASE.read_text())
    doc["ops"][0]["op"] = "snapshots"  # neither the old nor the new name
    with pytest.raises(TraceError, match=r"ops\[0\]\.op: unknown op 'snapshots'"):
        parse_trace(doc, "bad.json")
