"""The CLI's exit-code contract: 0 ran and agreed, 1 a divergence, 2 bad input or an unfit
environment with exactly one line on stderr naming the cause and the fix, never a traceback."""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tailproof.conformance.cli.main as cli
from tailproof.conformance.cli.main import main
from tailproof.conformance.harness import vllm_compat

GOOD: dict[str, Any] = {
    "format": "tailproof-trace/1",
    "name": "good",
    "config": {"groups": [{"kind": "full_attention", "block_size": 4},
                          {"kind": "mamba_align", "block_size": 8}],
               "hash_block_size": 4, "num_blocks": 16},
    "ops": [{"op": "add_request", "rid": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
            {"op": "new_step"},
            {"op": "lookup", "rid": "a", "expect": {"hit": 0}}],
}

CONN: dict[str, Any] = {
    "format": "tailproof-trace/1",
    "name": "conn",
    "config": {"groups": [{"kind": "full_attention", "block_size": 4},
                          {"kind": "mamba_align", "block_size": 8}],
               "hash_block_size": 4, "num_blocks": 16, "connector": {"role": "producer"}},
    "ops": [{"op": "add_request", "rid": "a", "tokens": [{"range": [1, 20]}]},
            {"op": "new_step"},
            {"op": "allocate", "rid": "a", "n": 8},
            {"op": "conn_step"},
            {"op": "commit", "rid": "a"},
            {"op": "worker_run"}],
}


def _doc(base: dict[str, Any], mutate: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    mutate(doc)
    return doc


def _write(tmp: Path, name: str, content: Any) -> str:
    p = tmp / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif isinstance(content, str):
        p.write_text(content)
    else:
        p.write_text(json.dumps(content))
    return str(p)


def _ops(doc: dict[str, Any], *ops: dict[str, Any]) -> None:
    doc["ops"].extend(ops)


# name -> (argv builder given tmp dir, words the stderr line must hold)
Case = tuple[Callable[[Path], list[str]], str]
MISUSE: dict[str, Case] = {
    "no_subcommand": (lambda t: [], "required"),
    "unknown_subcommand": (lambda t: ["frobnicate"], "invalid choice"),
    "unknown_option": (lambda t: ["validate", "--colour", "x.json"], "unrecognized"),
    "missing_file": (lambda t: ["replay", str(t / "nope.json"), "--against", "reference"],
                     "cannot read"),
    "empty_directory": (lambda t: ["validate", str(t)], "no *.json"),
    "empty_file": (lambda t: ["validate", _write(t, "e.json", "")], "invalid JSON"),
    "invalid_json": (lambda t: ["validate", _write(t, "b.json", "{\"format\": ")],
                     "invalid JSON at line 1"),
    "binary_file": (lambda t: ["validate", _write(t, "b.json", b"\xff\xfe\x00\x81garbage")],
                    "not UTF-8"),
    "deep_nesting": (lambda t: ["validate", _write(t, "d.json", "[" * 5000 + "]" * 5000)],
                     "nested deeper"),
    "moderate_nesting_in_expect": (lambda t: ["validate", _write(t, "d.json", _doc(
        GOOD, lambda d: d["ops"][2].update(expect={"x": json.loads("[" * 60 + "]" * 60)})))],
        "nested deeper"),
    "huge_int_literal": (lambda t: ["validate", _write(
        t, "h.json", json.dumps(GOOD).replace('"num_blocks": 16', '"num_blocks": ' + "9" * 5000))],
        "invalid JSON"),
    "op_is_list": (lambda t: ["validate", _write(t, "o.json", _doc(
        GOOD, lambda d: d["ops"].append({"op": ["lookup"]})))], "ops[3].op"),
    "op_is_object": (lambda t: ["validate", _write(t, "o.json", _doc(
        GOOD, lambda d: d["ops"].append({"op": {"x": 1}})))], "ops[3].op"),
    "expect_not_object": (lambda t: ["validate", _write(t, "x.json", _doc(
        GOOD, lambda d: d["ops"][2].update(expect=[1])))], "ops[2].expect"),
    "expect_malformed_refcounts": (lambda t: ["validate", _write(t, "x.json", _doc(
        GOOD, lambda d: _ops(d, {"op": "pool_state", "expect": {"refcounts": [1, 2]}})))],
        "ops[3].expect"),
    "huge_token_range": (lambda t: ["validate", _write(t, "r.json", _doc(
        GOOD, lambda d: d["ops"][0].update(tokens=[{"range": [0, 10**12]}])))],
        "over the limit"),
    "huge_fill": (lambda t: ["validate", _write(t, "r.json", _doc(
        GOOD, lambda d: d["ops"][0].update(tokens=[{"fill": 1, "n": 10**10}])))],
        "over the limit"),
    "token_id_2_63": (lambda t: ["validate", _write(t, "r.json", _doc(
        GOOD, lambda d: d["ops"][0].update(tokens=[1, 2**63])))], "2^63"),
    "block_size_2_63": (lambda t: ["validate", _write(t, "b.json", _doc(
        GOOD, lambda d: d["config"]["groups"][1].update(block_size=2**63)))],
        "config.groups[1].block_size"),
    "num_blocks_1e9": (lambda t: ["validate", _write(t, "n.json", _doc(
        GOOD, lambda d: d["config"].update(num_blocks=10**9)))], "config.num_blocks"),
    "pool_too_large": (lambda t: ["validate", _write(t, "n.json", _doc(
        GOOD, lambda d: (d["config"].update(num_blocks=60000),
                         d["config"]["groups"][1].update(block_size=4096))))],
        "token slots"),
    "evict_block_out_of_range": (lambda t: ["validate", _write(t, "e.json", _doc(
        GOOD, lambda d: _ops(d, {"op": "evict", "blocks": [99]})))], "ops[3].blocks"),
    "commit_count_huge": (lambda t: ["validate", _write(t, "c.json", _doc(
        GOOD, lambda d: _ops(d, {"op": "commit", "rid": "a", "n": 2**70})))], "ops[3].n"),
    "store_seed_key_group": (lambda t: ["validate", _write(t, "s.json", _doc(
        CONN, lambda d: _ops(d, {"op": "store_seed", "rid": "a", "keys": [[5, 4]]})))],
        "ops[6].keys[0]"),
    "store_remove_key_boundary": (lambda t: ["validate", _write(t, "s.json", _doc(
        CONN, lambda d: _ops(d, {"op": "store_remove", "rid": "a", "keys": [[0, 400]]})))],
        "ops[6].keys[0]"),
    "worker_run_before_commit": (lambda t: ["validate", _write(t, "w.json", _doc(
        CONN, lambda d: d["ops"].insert(4, {"op": "worker_run"})))], "ops[4].op"),
    "worker_out_of_range": (lambda t: ["validate", _write(t, "w.json", _doc(
        CONN, lambda d: d["ops"][5].update(worker=3)))], "ops[5].worker"),
    "bad_store_script": (lambda t: ["validate", _write(t, "w.json", _doc(
        CONN, lambda d: d["ops"][5].update(store=["explode"])))], "ops[5].store"),
    "unknown_adapter": (lambda t: ["replay", _write(t, "g.json", GOOD), "--against", "nope"],
                        "unknown adapter 'nope'"),
    "empty_adapter_list": (lambda t: ["replay", _write(t, "g.json", GOOD), "--against", ","],
                           "no adapter"),
    "check_unknown_adapter": (lambda t: ["check", "--adapters", "bogus"],
                              "unknown adapter 'bogus'"),
    "record_unknown_adapter": (lambda t: ["record", _write(t, "g.json", GOOD),
                                          "--adapter", "bogus"], "invalid choice"),
    "bad_store_choice": (lambda t: ["replay", _write(t, "g.json", GOOD), "--store", "redis"],
                         "invalid choice"),
    "junit_dir_missing": (lambda t: ["replay", _write(t, "g.json", GOOD), "--against",
                                     "reference", "--junit", str(t / "no" / "r.xml")],
                          "--junit"),
    "prove_export_not_dir": (lambda t: ["prove", "--export", str(t / "none")], "--export"),
    "record_output_and_in_place": (lambda t: ["record", _write(t, "g.json", GOOD), "--adapter",
                                              "reference", "-o", str(t / "o.json"),
                                              "--in-place"], "-o/--output"),
    "record_two_to_stdout": (lambda t: ["record", _write(t, "g.json", GOOD),
                                        _write(t, "h.json", GOOD), "--adapter", "reference"],
                             "-o and stdout take one"),
    "show_bad_ops_range": (lambda t: ["replay", _write(t, "g.json", GOOD), "--against",
                                      "reference", "--show", "--ops", "9:2"], "--ops"),
    "capture_unknown_workload": (lambda t: ["capture", "--workload", "nope", "-o",
                                            str(t / "c.json")], "--workload"),
    "capture_unknown_geometry": (lambda t: ["capture", "--workload", "chat", "--geometry", "x",
                                            "-o", str(t / "c.json")], "--geometry"),
    "capture_bad_max_bytes": (lambda t: ["capture", "--workload", "chat", "--max-bytes", "0",
                                         "-o", str(t / "c.json")], "--max-bytes"),
    "capture_bad_connector": (lambda t: ["capture", "--workload", "chat", "--connector", "lm",
                                         "-o", str(t / "c.json")], "invalid choice"),
    "shrink_unknown_adapter": (lambda t: ["shrink", _write(t, "g.json", GOOD), "--against",
                                          "reference,nope"], "unknown adapter 'nope'"),
    "shrink_nothing_to_shrink": (lambda t: ["shrink", _write(t, "g.json", GOOD), "--against",
                                            "reference"], "no divergence"),
    "stats_not_http": (lambda t: ["stats", "ftp://127.0.0.1/metrics"], "not an http"),
    "stats_unreachable": (lambda t: ["stats", "http://127.0.0.1:9/metrics", "--timeout", "2"],
                          "cannot read"),
    "stats_bad_timeout": (lambda t: ["stats", "127.0.0.1:9", "--timeout", "0"], "--timeout"),
    "stats_timeout_not_number": (lambda t: ["stats", "127.0.0.1:9", "--timeout", "soon"],
                                 "invalid float"),
}


def _assert_one_line(err: str, words: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    assert lines[0].startswith("tailproof"), lines[0]
    assert words in lines[0], lines[0]
    assert "fix:" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_misuse_exit_2_one_line(name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    build, words = MISUSE[name]
    argv = build(tmp_path)
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, (rc, out.err)
    assert out.out == ""
    _assert_one_line(out.err, words)
    assert not out.err.startswith("tailproof: tailproof"), out.err  # the name said once


def test_misuse_matrix_is_wide() -> None:
    assert len(MISUSE) >= 25


# --- environment: packages missing, wrong vLLM, changed API --------------------------------


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any, **k: Any) -> Any:
        return None if name.split(".")[0] in modules else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_replay_without_torch_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "torch")
    rc = main(["replay", _write(tmp_path, "g.json", GOOD)])
    line = _assert_one_line(capsys.readouterr().err, "needs torch")
    assert rc == 2 and "--adapters reference" in line


def test_check_without_vllm_runs_reference_only(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "vllm")
    rc = main(["check", "--no-prove", "--json"])
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert rc == 0, out.err[-2000:]
    assert doc["adapters"] == ["reference"]
    assert set(doc["adapters_not_run"]) == {"vllm", "vllm-mooncake", "impl"}
    assert doc["vllm"]["missing"] == "vllm"


def test_prove_without_z3_exit_2(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "z3")
    assert main(["prove", "--quick"]) == 2
    line = _assert_one_line(capsys.readouterr().err, "z3-solver")
    assert "--no-prove" in line
    assert main(["check", "--adapters", "reference"]) == 2
    _assert_one_line(capsys.readouterr().err, "z3-solver")


def test_store_mooncake_without_package_exit_2(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="the impl adapter needs vLLM 0.33")
    _hide(monkeypatch, "mooncake")
    rc = main(["replay", _write(tmp_path, "g.json", GOOD), "--against", "reference,impl",
               "--store", "mooncake"])
    assert rc == 2
    _assert_one_line(capsys.readouterr().err, "Mooncake store package")


def test_unsupported_vllm_version_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="needs an installed vLLM to relabel")
    real = vllm_compat.detect

    def old() -> vllm_compat.VllmInfo:
        info = real()
        info.version = "0.31.0"
        return info

    monkeypatch.setattr(vllm_compat, "detect", old)
    rc = main(["replay", _write(tmp_path, "g.json", GOOD), "--against", "reference,vllm"])
    line = _assert_one_line(capsys.readouterr().err, "vLLM 0.31.0")
    assert rc == 2 and vllm_compat.SUPPORTED_TEXT in line
    # check refuses as well (a wrong vLLM is never silently skipped)
    assert main(["check", "--no-prove"]) == 2
    _assert_one_line(capsys.readouterr().err, "0.31.0")


def test_changed_api_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A monkeypatched signature (get_computed_blocks without max_cache_hit_length, as in
    vLLM 0.32) is refused before anything runs, naming the function and the parameter."""
    pytest.importorskip("vllm", reason="needs vLLM to patch")
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def get_computed_blocks(self: Any, request: Any) -> Any:
        raise AssertionError("must not run")

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    rc = main(["replay", _write(tmp_path, "g.json", GOOD), "--against", "reference,vllm"])
    line = _assert_one_line(capsys.readouterr().err, "KVCacheManager.get_computed_blocks")
    assert rc == 2 and "max_cache_hit_length" in line


# --- 0 and 1 --------------------------------------------------------------------------------


def test_exit_0_and_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, "g.json", GOOD)
    assert main(["replay", good, "--against", "reference"]) == 0
    bad = _write(tmp_path, "d.json", _doc(GOOD, lambda d: d["ops"][2].update(
        expect={"hit": 4})))
    capsys.readouterr()
    assert main(["replay", bad, "--against", "reference"]) == 1
    out = capsys.readouterr()
    assert "DIVERGENCE" in out.out and "Traceback" not in out.err


def test_every_bad_file_reported_directories_expanded(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    _write(d, "a_good.json", GOOD)
    _write(d, "b_bad.json", "{")
    _write(d, "notes.txt", "not a trace")
    other = _write(tmp_path, "c_bad.json", _doc(GOOD, lambda x: x.update(format="x")))
    rc = main(["validate", str(d), other, str(tmp_path / "missing.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 3, err
    assert "b_bad.json" in err[0] and "c_bad.json" in err[1] and "missing.json" in err[2]
    assert main(["validate", str(d / "a_good.json"), str(d)]) == 2
    assert main(["replay", str(d / "a_good.json"), "--against", "reference"]) == 0


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="unknown adapter"):
        main(["--debug", "replay", _write(tmp_path, "g.json", GOOD), "--against", "nope"])


# --- help and version -----------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tailproof import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tailproof {__version__}"


def test_every_option_has_help_and_plain_text() -> None:
    parser = cli.build_parser()
    assert "``" not in (parser.description or "")
    subs = next(a for a in parser._actions if a.dest == "cmd")
    assert set(subs.choices) >= {"check", "replay", "validate", "record", "prove", "doctor",
                                 "stats", "capture", "shrink"}
    for name, sp in subs.choices.items():
        assert "``" not in (sp.description or ""), name
        fmt = sp._get_formatter()
        for action in sp._actions:
            assert action.help, (name, action.dest)
            if action.option_strings and action.dest != "help":
                shown = fmt._get_help_string(action) or ""
                assert "default" in shown or "unset:" in shown, (name, action.dest, shown)
        text = sp.format_help()
        assert "``" not in text, name
    replay = subs.choices["replay"].format_help()
    assert "(default: reference,vllm)" in replay
