"""The step builder, the lockstep runner and the case author: the recipe of one engine step,
what it writes with and without observations, the first divergence stops a lockstep run, and
the core case scripts still write the stored corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.harness.lockstep import Lockstep, LockstepDivergence, replay_lockstep
from tailproof.conformance.harness.steps import Steps, op

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"groups": [{"kind": "full_attention", "block_size": 2},
                     {"kind": "mamba_align", "block_size": 4}],
          "hash_block_size": 2, "num_blocks": 20}


def _written(connector: bool = False, **step: Any) -> list[str]:
    ops: list[dict[str, Any]] = []
    Steps(ops.append, connector).step(**step)
    return [o["op"] for o in ops]


def test_op_writes_only_fields_that_differ_from_defaults() -> None:
    assert op("plan_chunk", rid="a", use_hit=False, external=0, budget=None) == {
        "op": "plan_chunk", "rid": "a"}
    assert op("allocate", rid="a", n="plan", use_hit=True) == {
        "op": "allocate", "rid": "a", "n": "plan", "use_hit": True}
    with pytest.raises(ValueError, match="no field 'bogus'"):
        op("commit", rid="a", bogus=1)


def test_one_step_in_scheduler_order() -> None:
    assert _written(run=["a"], admit=["b"]) == [
        "new_step", "plan_chunk", "allocate", "lookup", "plan_chunk", "allocate",
        "drain_offloads", "drain_copies", "release_retained", "commit", "commit"]
    assert _written(connector=True, admit=["b"], finished=["c"]) == [
        "new_step", "lookup", "sched_lookup", "plan_chunk", "allocate", "drain_offloads",
        "drain_copies", "release_retained", "conn_step", "commit"]
    assert _written(run=["a"], n={"a": 1}) == [
        "new_step", "allocate", "drain_offloads", "drain_copies", "release_retained", "commit"]


def test_observations_decide_what_follows() -> None:
    """An empty chunk is not allocated, a failed allocation not committed, and nothing is
    released when no retention was drained."""
    run = Lockstep({**CONFIG, "num_blocks": 3}, ["reference"])
    run.apply(op("add_request", rid="a", tokens=list(range(9))))
    Steps(run.apply).step(admit=["a"])
    assert [o["op"] for o in run.ops[1:]] == [
        "new_step", "lookup", "plan_chunk", "allocate", "drain_offloads", "drain_copies"]
    assert run.observed[4] == {"ok": False, "new": None, "free": 2}


@pytest.mark.vllm
def test_lockstep_stops_at_the_first_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference that frees blocks unreversed diverges from vLLM at the next snapshot; the
    raised trace ends there, with vLLM's observation as the expectation, and replays to the
    same divergence."""
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")
    from tailproof.reference import managers

    def free_unreversed(self: Any, request_id: str) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    monkeypatch.setattr(managers.FullAttentionManager, "free", free_unreversed)
    run = Lockstep(CONFIG, ["vllm", "reference"])
    run.apply(op("add_request", rid="a", tokens=[0, 0, 1, 1, 2, 2, 9]))
    Steps(run.apply).prefill("a", 3)
    run.apply(op("free", rid="a"))
    with pytest.raises(LockstepDivergence) as info:
        run.apply(op("pool_state"))
    e = info.value
    assert e.index == len(run.ops) - 1 == len(e.doc["ops"]) - 1
    assert e.doc["ops"][-1]["expect"] == e.observations[0] != e.observations[1]
    again = replay_lockstep(e.doc, ["vllm", "reference"])
    assert again is not None and again.index == e.index
    monkeypatch.undo()
    assert replay_lockstep(e.doc, ["vllm", "reference"]) is None


def test_core_case_scripts_write_the_stored_corpus() -> None:
    out = subprocess.run([sys.executable, "scripts/author_core_cases.py", "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from tailproof.conformance.tools.authoring.core_cases import ALL

    assert out.stderr.count("same as stored") == len(ALL) >= 35


def test_junction_case_scripts_write_the_stored_corpus() -> None:
    """The core_j cases are recorded from vLLM while authored (reference in lockstep); their
    scripts still produce the stored files, expectations included."""
    out = subprocess.run([sys.executable, "scripts/author_junction_cases.py", "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("same as stored") == 9
