"""The connector's release switches (``impl/vllm_release.py``, read from vLLM's own code) say
on each installed release what the reference's switches for that release say
(``reference/releases.py``, docs/releases.md): TailproofConnector and the reference follow the
same rules wherever a vLLM release is installed. vLLM is imported once per process, so each
release is read in a subprocess with the PYTHONPATH ``scripts/vllm_env.sh`` gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailproof.reference.releases import RELEASES

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
READ = ("import json; from tailproof.impl import vllm_release as r; print(json.dumps("
        "[r.resumed_as_cached(), r.preempted_tracker_dropped(), r.monotone_saved_offset(), "
        "r.decode_checkpoints()]))")


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_impl_switches_match_the_reference_release(release: str) -> None:
    env_path = subprocess.run([str(ROOT / "scripts" / "vllm_env.sh"), release], cwd=ROOT,
                              capture_output=True, text=True)
    if env_path.returncode != 0:
        pytest.skip(f"vLLM {release} is not installed here: {env_path.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": env_path.stdout.strip()}
    out = subprocess.run([sys.executable, "-c", READ], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    as_cached, dropped, monotone, decode = json.loads(out.stdout.strip().splitlines()[-1])
    rules = RELEASES[release]
    assert as_cached is not rules.resumed_as_new
    assert dropped is rules.preempted_tracker_dropped
    assert monotone is rules.monotone_saved_offset
    assert decode is rules.decode_checkpoints
