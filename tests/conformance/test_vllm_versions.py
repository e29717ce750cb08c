"""The suite against vLLM 0.32.0 (an overlay folder built by scripts/vllm_overlay.sh, put
first on PYTHONPATH): the vLLM-backed adapters are refused with exit 2 naming the version and
the changed API; the reference adapter still runs the whole corpus. docs/ci.md's
compatibility table states this result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "tailproof"


@pytest.fixture(scope="module")
def overlay() -> Path:
    if not EXE.exists():
        pytest.skip("the tailproof console script is not installed in this environment")
    try:
        proc = subprocess.run([str(ROOT / "scripts" / "vllm_overlay.sh"), "0.32.0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "TAILPROOF_VENV": str(Path(sys.prefix))})
    except subprocess.TimeoutExpired:
        pytest.skip("building the vLLM 0.32.0 overlay took over 30 minutes")
    if proc.returncode != 0:
        pytest.skip(f"cannot build the vLLM 0.32.0 overlay (pip install --no-deps "
                    f"vllm==0.32.0 failed: {proc.stderr.strip()[-300:]})")
    return ROOT / proc.stdout.strip()


def _tailproof(overlay: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(overlay)}
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)


def test_vllm_032_refused_naming_version_and_api(overlay: Path) -> None:
    proc = _tailproof(overlay, "check", "--no-prove", "--json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "vLLM 0.32.0 (installed package" in lines[0]
    assert ">=0.33.0,<0.34" in lines[0]
    assert "get_computed_blocks: no parameter max_cache_hit_length" in lines[0]
    assert "fix:" in lines[0]


def test_vllm_032_reference_suite_runs(overlay: Path) -> None:
    proc = _tailproof(overlay, "check", "--no-prove", "--json", "--adapters", "reference")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["vllm"]["version"] == "0.32.0" and not doc["vllm"]["supported"]
    assert Path(doc["vllm"]["path"]).parent == overlay.resolve()
    assert doc["result"] == "agreed" and doc["cases"] >= 70
