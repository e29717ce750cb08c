"""A trace names the vLLM release it expects (``config.vllm``, docs/releases.md): the
reference follows it, one switch per difference; the vLLM-backed adapters run the installed
release and refuse a trace of the other one only where the two disagree on it; each 0.34
counterpart runs its 0.33 case's ops and differs from it."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from tailproof.conformance.format.trace import FORMAT_TAG, load_trace, parse_trace
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.releases import ReleaseGate
from tailproof.conformance.tools.authoring.release_cases import COUNTERPARTS, SUFFIX
from tailproof.reference.releases import RELEASES, Release, release

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "conformance" / "cases"
DOCS = ROOT / "docs" / "releases.md"

DOC: dict[str, Any] = {
    "format": FORMAT_TAG, "name": "t",
    "config": {"groups": [{"kind": "full_attention", "block_size": 2},
                          {"kind": "mamba_align", "block_size": 4}],
               "hash_block_size": 2, "num_blocks": 20},
    "ops": [{"op": "add_request", "rid": "r0", "tokens": list(range(8))},
            {"op": "new_step"}, {"op": "lookup", "rid": "r0"},
            {"op": "plan_chunk", "rid": "r0", "use_hit": True},
            {"op": "allocate", "rid": "r0", "n": "plan", "use_hit": True},
            {"op": "commit", "rid": "r0"}],
}


def _doc(**config: Any) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["config"].update(config)
    return doc


def test_absent_release_reads_as_033() -> None:
    assert parse_trace(_doc()).config.vllm == "0.33"
    assert parse_trace(_doc(vllm="0.34")).config.vllm == "0.34"
    assert parse_trace(_doc(num_hash_lookahead_tokens=0)).config.vllm == "0.33"


def test_one_switch_per_difference_each_in_the_docs_table() -> None:
    switches = [f.name for f in fields(Release) if f.name != "name"]
    assert set(RELEASES) == {"0.33", "0.34"}
    assert release(None) is RELEASES["0.33"]
    for name in switches:  # every switch differs between the two, so it is one difference
        assert getattr(RELEASES["0.33"], name) != getattr(RELEASES["0.34"], name), name
    table = DOCS.read_text()
    for name in switches:
        assert f"| `{name}` |" in table, name


def test_gate_runs_a_neutral_trace_and_refuses_a_differing_one() -> None:
    neutral = parse_trace(_doc())
    assert ReleaseGate(neutral, installed="0.34").refusal("vllm-mooncake") is None
    assert ReleaseGate(neutral, installed="0.34").refusal("reference") is None
    clamp = load_trace(CASES / "core_c54_lookup_bound_taken_as_given.json")
    why = ReleaseGate(clamp, installed="0.34").refusal("vllm")
    assert why is not None and "config.vllm is 0.33" in why and "(lookup)" in why
    assert ReleaseGate(clamp, installed="0.33").refusal("vllm") is None


def test_gate_counts_only_the_ops_a_core_adapter_observes() -> None:
    t = load_trace(CASES / "conn_w01_window_store_mask_skips_null_chunk.json")
    gate = ReleaseGate(t, installed="0.34")
    assert gate.first_difference() is not None  # a worker_run differs
    assert gate.refusal("vllm-mooncake") is not None
    assert gate.refusal("vllm") is None  # it stops observing at the first connector op


def test_every_counterpart_differs_from_its_033_case_on_the_reference() -> None:
    for stem in COUNTERPARTS:
        old = load_trace(CASES / f"{stem}.json")
        new = load_trace(CASES / f"{stem}{SUFFIX}.json")
        assert new.config.vllm == "0.34" and old.config.vllm == "0.33"
        assert [o["op"] for o in old.ops] == [o["op"] for o in new.ops], stem
        assert ReleaseGate(old, installed="0.34").first_difference() is not None, stem
        assert ReleaseGate(new, installed="0.33").first_difference() is not None, stem


def test_every_034_case_names_its_release() -> None:
    for p in corpus_paths():
        if "v034" in p.name:
            assert json.loads(p.read_text())["config"].get("vllm") == "0.34", p.name
