"""The step protocol (conformance/format/step_protocol.py): every break is exit 2 naming the op, in
``validate`` and ``replay`` alike; ``replay`` and ``shrink`` also judge it with the outcomes
of the allocations they ran; the table of observed keys matches what the adapters observe."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.observations import OBSERVES
from tailproof.conformance.format.step_protocol import observed_problem
from tailproof.conformance.format.trace import FORMAT_TAG, load_trace, parse_trace
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.replay import run_trace
from tailproof.conformance.tools.shrink import _Oracle

BASE: dict[str, Any] = {
    "format": FORMAT_TAG, "name": "p",
    "config": {"groups": [{"kind": "full_attention", "block_size": 4}],
               "hash_block_size": 4, "num_blocks": 16},
}
STEP = [{"op": "add_request", "rid": "a", "tokens": [1, 2, 3, 4, 5, 6]},
        {"op": "new_step"},
        {"op": "allocate", "rid": "a", "n": 6, "expect": {"ok": True}},
        {"op": "commit", "rid": "a"},
        {"op": "new_step"},
        {"op": "append_output", "rid": "a", "tokens": [7]},
        {"op": "allocate", "rid": "a", "n": 1, "expect": {"ok": True}},
        {"op": "commit", "rid": "a"}]


def _doc(ops: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["ops"] = copy.deepcopy(ops)
    doc["config"].update(config)
    return doc


def _rc(cmd: list[str], doc: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    rc = main([*cmd, str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 1, err
    return rc, err[0] if err else ""


BREAKS = {
    "duplicated commit": (STEP[:4] + [STEP[3]] + STEP[4:], "ops[4].op: commit of 'a' with no "
                          "allocate since its last commit"),
    "stray commit": ([STEP[0], STEP[1], STEP[3]], "ops[2].op: commit of 'a' with no allocate"),
    "commit of a failed allocation": (
        [STEP[0], STEP[1], dict(STEP[2], expect={"ok": False}), STEP[3]],
        "ops[3].op: commit of 'a' with no allocate"),
    "missing commit": (STEP[:3] + STEP[4:], "ops[5].op: allocate of 'a' while its allocate "
                       "at ops[2] (ok) was never committed"),
    "unknown expect key": ([STEP[0], dict(STEP[1], expect={"hit": 3})],
                           "ops[1].expect.hit: no adapter observes 'hit' on op 'new_step'"),
}


@pytest.mark.parametrize("cmd", [["validate"], ["replay", "--against", "reference"]])
@pytest.mark.parametrize("case", sorted(BREAKS))
def test_break_is_exit_2_naming_the_op(case: str, cmd: list[str], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    ops, want = BREAKS[case]
    rc, line = _rc(cmd, _doc(ops), tmp_path, capsys)
    assert rc == 2 and want in line, line


@pytest.mark.parametrize("key", ["max_model_len", "max_num_scheduled_tokens"])
def test_zero_token_geometry_refused(key: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, line = _rc(["validate"], _doc(STEP, **{key: 0}), tmp_path, capsys)
    assert rc == 2 and f"config.{key}: must be >= 1, got 0" in line


def test_conn_step_scheduled_request_committed_before_next_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ops = [STEP[0], STEP[1], STEP[2], {"op": "conn_step"}, {"op": "new_step"}]
    rc, line = _rc(["validate"], _doc(ops, connector={"role": "producer"}), tmp_path, capsys)
    assert rc == 2 and "ops[4].op: new_step before the commit of 'a', which the conn_step at " \
                       "ops[3] scheduled" in line


def test_good_step_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _rc(["validate"], _doc(STEP), tmp_path, capsys)[0] == 0
    assert _rc(["replay", "--against", "reference"], _doc(STEP), tmp_path, capsys)[0] == 0


def test_dropped_commit_without_expectations_refused_by_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``expect.ok`` the loader cannot know the allocation succeeds; the replay knows
    once it ran, and refuses instead of reporting what the broken trace causes."""
    ops = [{k: v for k, v in op.items() if k != "expect"} for op in STEP[:3] + STEP[4:]]
    assert _rc(["validate"], _doc(ops), tmp_path, capsys)[0] == 0
    rc, line = _rc(["replay", "--against", "reference"], _doc(ops), tmp_path, capsys)
    assert rc == 2 and "allocate of 'a' while its allocate at ops[2] (ok) was never " \
                       "committed (as run on reference)" in line


def test_shrink_never_takes_a_candidate_that_drops_a_commit() -> None:
    ops = [{k: v for k, v in op.items() if k != "expect"} for op in STEP]
    trace = parse_trace(_doc(ops), protocol=True)
    sig = ("reference", "expected", "commit", "computed")  # whatever: only the veto matters
    oracle = _Oracle({k: v for k, v in _doc(ops).items() if k != "ops"}, ["reference"], True,
                     sig)
    dropped = [op for j, op in enumerate(ops) if j != 3]
    assert oracle.trace(dropped) is not None  # the loader alone lets it through
    res = run_trace(oracle.trace(dropped), ["reference"], True)
    assert observed_problem(oracle.trace(dropped).ops,
                            res.observations["reference"]) is not None
    assert not oracle.keeps(dropped)
    assert observed_problem(trace.ops, run_trace(trace, ["reference"]).observations[
        "reference"]) is None


def test_in_process_parse_stays_permissive() -> None:
    """The in-process fuzzers drive off-protocol sequences on purpose (the reference and vLLM
    must agree there too): only the CLI's loader and shrink apply the protocol."""
    ops, _ = BREAKS["duplicated commit"]
    assert len(parse_trace(_doc(ops)).ops) == len(ops)
    with pytest.raises(ValueError, match="commit of 'a' with no allocate"):
        parse_trace(_doc(ops), protocol=True)


def test_observed_keys_table_covers_every_observation() -> None:
    """Every key the reference adapter observes on the corpus, and every key the corpus
    expects, is in the loader's table (and the table names no op that does not exist)."""
    from tailproof.conformance.format.ops import all_op_specs

    assert set(OBSERVES) == set(all_op_specs())
    seen: dict[str, set[str]] = {}
    for p in corpus_paths():
        t = load_trace(p)
        res = run_trace(t, ["reference"])
        for op, obs in zip(t.ops, res.observations["reference"], strict=True):
            seen.setdefault(op["op"], set()).update(obs or {}, op.get("expect") or {})
    for name, keys in seen.items():
        assert keys <= OBSERVES[name], (name, keys - OBSERVES[name])
