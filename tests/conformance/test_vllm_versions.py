"""The suite against each vLLM release the bootstrap installs (requirements/vllm-releases.txt:
the venv's own 0.34, the overlays .venv-vllm033 and .venv-vllm032), one subprocess per
release with the PYTHONPATH of scripts/vllm_env.sh; nothing is fetched. 0.33 and 0.34 are
accepted with every probe of their own table passing and replay on all four adapters; 0.32 is
refused with exit 2 naming the version and the changed API, while the reference adapter still
runs the whole corpus. docs/ci.md's compatibility table states this result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailproof.conformance.harness import vllm_compat

ROOT = Path(__file__).resolve().parents[2]
#: corpus cases that agree on every adapter on both releases (a core case, a connector case
#: with preemption, a captured one; docs/notes-034-divergences.md lists the ones that do not)
AGREED = ("core_c15_preempt_and_resume.json", "conn_resumed_prefill_claims_past_prompt.json",
          "cap_chat_fa16-m16-h4_mooncake.json")


def _pythonpath(release: str) -> str:
    """The PYTHONPATH selecting ``release`` ("" for the venv's own); a release the bootstrap
    did not install fails the test (CI bootstraps every one, so it never skips there)."""
    proc = subprocess.run([str(ROOT / "scripts" / "vllm_env.sh"), release], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail(f"vLLM {release} is not installed here: {proc.stderr.strip()} "
                    "(./scripts/bootstrap.sh installs every release of "
                    "requirements/vllm-releases.txt)")
    return proc.stdout.strip()


def _tailproof(release: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _pythonpath(release)}
    return subprocess.run([sys.executable, "-m", "tailproof", *args], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)


def test_vllm_032_refused_naming_version_and_api() -> None:
    proc = _tailproof("0.32", "check", "--no-prove", "--json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "vLLM 0.32.0 (installed package" in lines[0]
    assert vllm_compat.SUPPORTED_TEXT in lines[0] and "0.33, 0.34" in lines[0]
    assert "get_computed_blocks: no parameter max_cache_hit_length" in lines[0]
    assert "fix:" in lines[0]


def test_vllm_032_reference_suite_runs() -> None:
    proc = _tailproof("0.32", "check", "--no-prove", "--json", "--adapters", "reference")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["vllm"]["version"] == "0.32.0" and not doc["vllm"]["supported"]
    assert Path(doc["vllm"]["path"]).parent == (ROOT / ".venv-vllm032").resolve()
    assert doc["result"] == "agreed" and doc["cases"] >= 70


@pytest.mark.parametrize("release", vllm_compat.RELEASES)
def test_supported_release_accepted(release: str) -> None:
    """The release's own probe table passes (doctor), the other release's table does not
    (the tables tell the two apart), and cases replay on all four adapters, ids strict."""
    proc = _tailproof(release, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["vllm"]["version"].startswith(release + ".")
    assert doc["vllm"]["supported"] and doc["vllm"]["api_problems"] == {}
    assert doc["vllm_release"] == release
    probes = doc["vllm_release_probes"]
    assert probes[release] == {}
    assert all(probes[r] for r in vllm_compat.RELEASES if r != release)
    cases = [str(ROOT / "conformance" / "cases" / c) for c in AGREED]
    proc = _tailproof(release, "replay", *cases, "--strict-ids", "--json",
                      "--against", "reference,vllm,vllm-mooncake,impl", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["vllm"]["version"].startswith(release + ".") and doc["vllm"]["supported"]
    assert doc["result"] == "agreed" and doc["cases"] == len(AGREED)
    assert doc["adapters"] == ["reference", "vllm", "vllm-mooncake", "impl"]
    assert doc["strict_ids"] and set(doc["skipped_ops"]) <= {"vllm"}  # core only: no conn ops


@pytest.mark.parametrize("release", vllm_compat.RELEASES)
def test_token_ids_past_the_release_limit_refused(release: str, tmp_path: Path) -> None:
    """A token id the release's Request cannot hold (int32 on 0.34) is refused with exit 2
    and one line naming the trace, op and limit; below it (2^31 - 1) the trace replays."""
    limit = 1 << 31
    for tok, ok in ((limit - 1, True), (limit, release == "0.33")):
        doc = {"format": "tailproof-trace/1", "name": f"ids{tok}",
               "config": {"groups": [{"kind": "full_attention", "block_size": 4},
                                     {"kind": "mamba_align", "block_size": 8}],
                          "hash_block_size": 4, "num_blocks": 16},
               "ops": [{"op": "add_request", "rid": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8]},
                       {"op": "add_request", "rid": "b", "tokens": [1, 2, 3, tok, 5, 6]},
                       {"op": "new_step"},
                       {"op": "lookup", "rid": "b", "expect": {"hit": 0}}]}
        path = tmp_path / f"t{tok}.json"
        path.write_text(json.dumps(doc))
        proc = _tailproof(release, "replay", str(path), "--against", "reference,vllm")
        if ok:
            assert proc.returncode == 0, (tok, proc.stderr[-2000:])
            continue
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
        assert "op 1 (add_request)" in lines[0] and "vllm" in lines[0]
        assert f"token id {limit} is not below 2^31" in lines[0]
