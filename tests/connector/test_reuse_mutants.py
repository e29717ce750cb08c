"""The reuse extension's seeded mutants (turn-end and junction checkpoints) in ``tailproof.impl``
(``conformance/tools/mutate/impl_extension.py``) are each killed by an extension case replayed on
``reference,impl`` with strict ids, and the unmutated impl agrees with the reference."""

from __future__ import annotations

from typing import Any

import pytest

from tailproof.conformance.harness.adapters import make_driver

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

from tailproof.conformance.tools.mutate.impl_extension import (  # noqa: E402
    MUTANTS,
    applied,
    extension_cases,
    first_kill,
)

# Mutants whose wrong bytes the impl adapter's runner_sim sees on its own (no reference needed).
BYTE_VISIBLE = {"te-wrong-boundary", "te-snapshot-one-step-late", "te-slot-pin-released-early",
                "te-snapshot-copy-skipped", "jn-snapshot-not-copied"}
# (jn-wrong-boundary's key J - h is already stored in every junction case, so the worker skips
# the put: killed by the job's observed puts, not by bytes.)
JUNCTION_CASES = ("conn_x14", "conn_x15", "conn_x16", "conn_x17", "conn_x18", "conn_x19",
                  "conn_x20", "conn_x21", "conn_x22")


@pytest.fixture(scope="module")
def traces() -> list[Any]:
    ts = extension_cases()
    assert len(ts) >= 20
    return ts


def test_unmutated_impl_agrees(traces: list[Any]) -> None:
    assert first_kill(traces) is None


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_killed_by_an_extension_case(mutant: Any, traces: list[Any]) -> None:
    with applied(mutant):
        kill = first_kill(traces)
    assert kill is not None, f"{mutant.id} survived the extension cases"
    assert kill[0].startswith("conn_x")
    assert first_kill(traces) is None  # undone


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.id.startswith("jn-")],
                         ids=lambda m: m.id)
def test_junction_mutant_killed_by_a_junction_case(mutant: Any, traces: list[Any]) -> None:
    """Each junction mutant is killed by a junction case alone (not only by a turn-end one)."""
    junction = [t for t in traces if t.name.startswith(JUNCTION_CASES)]
    assert {t.name[:8] for t in junction} == set(JUNCTION_CASES)
    with applied(mutant):
        kill = first_kill(junction)
    assert kill is not None and kill[0].startswith(JUNCTION_CASES), mutant.id


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.id in BYTE_VISIBLE],
                         ids=lambda m: m.id)
def test_mutant_stores_wrong_bytes(mutant: Any, traces: list[Any]) -> None:
    """Beyond differing observations: some put moves bytes that are not its prefix's KV."""
    errors = []
    with applied(mutant):
        for t in traces:
            d = make_driver("impl", t.config)
            errors += [op["op"] for op in t.ops
                       if (o := d.apply(op)) is not None and o.get("error") == "KVByteMismatch"]
    assert "worker_run" in errors


def test_mutate_cli_scores_the_extension_mutants(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tailproof.conformance.cli.main import main

    assert main(["mutate", "--extension", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(m.id in listed for m in MUTANTS)
    assert main(["mutate", "--extension", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {m.id for m in MUTANTS}
    assert all(k is not None and k["trace"].startswith("conn_x") for k in out.values())
