"""Malformed traces are rejected before anything runs: one line naming the field, exit 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.trace import FORMAT_TAG

GOOD: dict[str, Any] = {
    "format": FORMAT_TAG,
    "name": "good",
    "config": {"groups": [{"kind": "full_attention", "block_size": 4},
                          {"kind": "mamba_align", "block_size": 8}],
               "hash_block_size": 4, "num_blocks": 16},
    "ops": [{"op": "add_request", "rid": "a", "tokens": [1, 2, 3, 4, 5]},
            {"op": "lookup", "rid": "a"}],
}


def _bad(mutate: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    mutate(doc)
    return doc


CASES = {
    "unknown_op": (lambda d: d["ops"].append({"op": "explode"}), "ops[2].op", "unknown op"),
    "h_not_dividing": (lambda d: d["config"].update(hash_block_size=3),
                       "config.hash_block_size", "does not divide"),
    "non_align_mamba": (lambda d: d["config"]["groups"][1].update(mamba_cache_mode="all"),
                        "config.groups[1].kind", "align mode"),
    "plain_mamba_kind": (lambda d: d["config"]["groups"][1].update(kind="mamba"),
                         "config.groups[1].kind", "align mode"),
    "negative_count": (lambda d: d["ops"].append({"op": "commit", "rid": "a", "n": -3}),
                       "ops[2].n", "int >= 0"),
    "negative_token": (lambda d: d["ops"][0].update(tokens=[1, -2]), "ops[0].tokens",
                       "negative"),
    "unknown_request": (lambda d: d["ops"].append({"op": "free", "rid": "zz"}), "ops[2].rid",
                        "unknown request id"),
    "bad_format_tag": (lambda d: d.update(format="tailproof-trace/0"), "format", "expected"),
    "unknown_field": (lambda d: d["ops"][1].update(colour="red"), "ops[1].colour",
                      "unknown field"),
    "missing_field": (lambda d: d["ops"].append({"op": "truncate", "rid": "a"}), "ops[2].n",
                      "required"),
    "window_without_size": (lambda d: d["config"]["groups"][0].update(kind="sliding_window"),
                            "config.groups[0].sliding_window", "int > 0"),
    "window_on_full_attention": (lambda d: d["config"]["groups"][0].update(sliding_window=8),
                                 "config.groups[0].sliding_window", "only sliding_window"),
    "spec_blocks_negative": (lambda d: d["config"]["groups"][1].update(
        num_speculative_blocks=-1), "config.groups[1].num_speculative_blocks", "int >= 0"),
    "spec_blocks_not_int": (lambda d: d["config"]["groups"][1].update(
        num_speculative_blocks=True), "config.groups[1].num_speculative_blocks", "int >= 0"),
    "spec_blocks_on_attention": (lambda d: d["config"]["groups"][0].update(
        num_speculative_blocks=1), "config.groups[0].num_speculative_blocks",
        "only Mamba groups"),
    "unitary_finer_hash": (lambda d: d["config"].update(
        groups=[{"kind": "full_attention", "block_size": 8}]), "config.hash_block_size",
        "one group"),
    "vllm_unknown_release": (lambda d: d["config"].update(vllm="0.35"), "config.vllm",
                             "must be one of '0.33', '0.34'"),
    "vllm_not_a_string": (lambda d: d["config"].update(vllm=0.34), "config.vllm",
                          "must be one of"),
    "hash_lookahead": (lambda d: d["config"].update(num_hash_lookahead_tokens=3),
                       "config.num_hash_lookahead_tokens", "not modelled"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_malformed_trace_one_line_exit_2(kind: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    mutate, field, words = CASES[kind]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_bad(mutate)))
    # The good trace comes first: nothing may run before the bad one is rejected.
    rc = main(["replay", str(good), str(bad), "--against", "reference"])
    err = capsys.readouterr()
    assert rc == 2
    assert err.out == ""
    lines = err.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"bad.json: {field}: " in lines[0]
    assert words in lines[0]


def test_invalid_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{\"format\": ")
    assert main(["validate", str(bad)]) == 2
    assert "invalid JSON at line 1" in capsys.readouterr().err


def test_unknown_adapter_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    assert main(["replay", str(good), "--against", "nope"]) == 2
    assert "--against: unknown adapter 'nope'" in capsys.readouterr().err


def test_compact_tokens_expand(tmp_path: Path) -> None:
    from tailproof.conformance.format.trace import parse_trace

    doc = copy.deepcopy(GOOD)
    doc["ops"].append({"op": "add_request", "rid": "b",
                       "tokens": [{"prompt_of": "a", "n": 3}, {"fill": 7, "n": 2},
                                  {"range": [10, 12]}, 99]})
    t = parse_trace(doc)
    assert t.ops[-1]["tokens"] == [1, 2, 3, 7, 7, 10, 11, 99]


def test_request_id_reuse_needs_free() -> None:
    from tailproof.conformance.format.trace import TraceError, parse_trace

    doc = copy.deepcopy(GOOD)
    doc["ops"].append({"op": "add_request", "rid": "a", "tokens": [1]})
    with pytest.raises(TraceError, match=r"ops\[2\].rid: request 'a' is still live"):
        parse_trace(doc)
    doc["ops"].insert(2, {"op": "free", "rid": "a"})
    assert parse_trace(doc).ops[-1]["rid"] == "a"


def _step_order_doc(commit_after_worker: bool) -> dict[str, Any]:
    """A connector step where ``a`` is allocated and ``b``'s allocation (b cannot fit) is never
    committed; a worker runs after the commit of ``a`` or, when ``commit_after_worker``,
    before it."""
    doc = copy.deepcopy(GOOD)
    doc["config"]["connector"] = {"role": "producer", "num_workers": 1}
    doc["ops"] = [{"op": "add_request", "rid": "a", "tokens": [1, 2, 3, 4, 5]},
                  {"op": "add_request", "rid": "b", "tokens": [9] * 40},
                  {"op": "new_step"},
                  {"op": "allocate", "rid": "a", "n": 5},
                  {"op": "allocate", "rid": "b", "n": 40},
                  {"op": "conn_step"}]
    tail = [{"op": "commit", "rid": "a"}, {"op": "worker_run"}]
    doc["ops"] += tail[::-1] if commit_after_worker else tail
    return doc


def test_step_order_failed_allocation_is_not_awaited() -> None:
    """A request whose allocation failed is never committed: a worker may run after the
    step's commits (a generated trace with a failed admission loads)."""
    from tailproof.conformance.format.trace import TraceError, parse_trace

    parse_trace(_step_order_doc(commit_after_worker=False))
    with pytest.raises(TraceError, match=r"ops\[6\]\.op: worker_run before the commit of 'a'"):
        parse_trace(_step_order_doc(commit_after_worker=True))
