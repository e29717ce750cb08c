"""``replay --show`` / ``--ops``, ``record -o`` / stdout / ``--in-place``, and an ``expect``
naming a field no adapter observes (bad input, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.harness.corpus import CASES_DIR

CASE = CASES_DIR / "core_c01_producer_subblock_tail.json"


def test_show_prints_every_op_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CASE), "--against", "reference", "--show", "--ops", "2:5"]) == 0
    out = capsys.readouterr().out
    assert "ops 2..4 of" in out
    assert "[2] " in out and "[4] " in out and "[5] " not in out and "[1] " not in out
    assert "expected:" in out and "reference:" in out


def test_show_marks_the_diverging_op(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(CASE.read_text())
    i = next(k for k, op in enumerate(doc["ops"]) if op["op"] == "lookup" and "expect" in op)
    doc["ops"][i]["expect"]["hit"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["replay", str(bad), "--against", "reference", "--show"]) == 1
    out = capsys.readouterr().out
    assert f"!![{i}] lookup" in out


def test_bad_ops_range_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CASE), "--against", "reference", "--show", "--ops", "x"]) == 2
    assert "--ops" in capsys.readouterr().err


def test_expect_key_nobody_observes_is_bad_input(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(CASE.read_text())
    i = next(k for k, op in enumerate(doc["ops"]) if op["op"] == "allocate")
    doc["ops"][i]["expect"] = {"hits": 3}
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps(doc))
    assert main(["replay", str(bad), "--against", "reference"]) == 2
    err = capsys.readouterr().err
    assert f"ops[{i}].expect.hits: no adapter observes 'hits'" in err


def test_record_to_file_stdout_and_in_place(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(CASE.read_text())
    for op in doc["ops"]:
        op.pop("expect", None)
    src = tmp_path / "bare.json"
    src.write_text(json.dumps(doc))
    before = src.read_text()
    out = tmp_path / "filled.json"
    assert main(["record", str(src), "--adapter", "reference", "-o", str(out)]) == 0
    assert src.read_text() == before  # not rewritten
    filled = json.loads(out.read_text())
    assert all("expect" in op for op in filled["ops"])
    capsys.readouterr()
    assert main(["record", str(src), "--adapter", "reference"]) == 0
    assert json.loads(capsys.readouterr().out) == filled
    assert main(["record", str(src), "--adapter", "reference", "--in-place"]) == 0
    assert json.loads(src.read_text()) == filled
    assert main(["record", str(src), str(out), "--adapter", "reference"]) == 2


def test_expect_is_record_with_its_new_name(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``tailproof expect --adapters A`` is the canonical spelling; ``record`` and ``--adapter``
    (and ``replay --against``) keep working as aliases, with the same output."""
    doc = json.loads(CASE.read_text())
    for op in doc["ops"]:
        op.pop("expect", None)
    src = tmp_path / "bare.json"
    src.write_text(json.dumps(doc))
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    assert main(["expect", str(src), "--adapters", "reference", "-o", str(new)]) == 0
    assert main(["record", str(src), "--adapter", "reference", "-o", str(old)]) == 0
    assert new.read_text() == old.read_text()
    capsys.readouterr()
    assert main(["replay", str(new), "--adapters", "reference", "--json"]) == 0
    by_new = json.loads(capsys.readouterr().out)
    assert main(["replay", str(new), "--against", "reference", "--json"]) == 0
    by_old = json.loads(capsys.readouterr().out)
    assert by_new["adapters"] == by_old["adapters"] == ["reference"]
    assert by_new["divergences"] == by_old["divergences"] == []
