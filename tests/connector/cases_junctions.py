"""The junction checkpoint extension's corpus (``docs/junctions.md``, "The extension"),
``conformance/cases/conn_x14``-``conn_x19``, as scheduler scripts
(``tailproof.conformance.author``).

Junction checkpoints are not in vLLM 0.33: these cases turn ``junction_checkpoints`` on in
``config.connector``, so the vLLM adapters refuse them and they are recorded from the reference
connector model (``reference/connector/junctions.py``) while ``impl`` runs in lockstep (strict
block ids, real KV bytes). Both adapters apply the scheduler hook (``Scheduler.
mamba_shared_prefix_checkpoint``), so a chunk stops exactly at a junction the connector set.
Each description says what the case pins.

    .venv/bin/python tests/connector/cases_junctions.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tailproof.conformance import author
from tailproof.conformance.author import FA, Case, M

RECORD = ("reference", "impl")
G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           **connector: Any) -> dict[str, Any]:
    """A producer connector with junction checkpoints on (``connector`` overrides)."""
    return author.config(groups, h, num_blocks, connector={
        "role": "producer", "junction_checkpoints": True, **connector})


def case(name: str, description: str, config_doc: dict[str, Any]) -> Case:
    return Case(name, description, config_doc, record=RECORD)


def rng(a: int, b: int) -> dict[str, list[int]]:
    return {"range": [a, b]}


def of(rid: str, n: int) -> dict[str, object]:
    return {"prompt_of": rid, "n": n}


def prefill_a(c: Case, chunks: int = 3) -> None:
    """A's 30-token prompt in its three planned chunks (16, ck 28, 30), its jobs run."""
    c.add("A", [rng(0, 30)])
    c.prefill("A", chunks)
    c.op("worker_run")
    c.op("worker_report")


def junction_stored_and_loaded() -> Case:
    c = case("conn_x14_junction_stored_and_loaded",
             "Junction checkpoint (docs/junctions.md, 'The extension'): A (30-token prompt, "
             "FA16+M16, h4) is prefilled. B shares A's first 22 tokens (5 whole hash blocks: "
             "junction 20, off the Mamba grid of 16, below B's ck 36, past B's local hit 16); "
             "the connector lookup sets B's shared_prefix_boundary to 20 (sched_lookup "
             "'junction') and B's chunk stops exactly there (4 tokens, not 24). That step copies "
             "B's running Mamba state into a fresh block (snapshots) and emits a same-step job "
             "putting FA block 1 under key 20 and the copy under the Mamba key 20, pinned, the "
             "connector's reference dropped at once (one block more free after the workers "
             "report). C shares the same 22 tokens: its local hit is 16, the store gives 20, and "
             "C loads the 4 tokens and the Mamba state at 20 byte-exact (impl: runner_sim).",
             config(G16, 4))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("conn_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    c.op("snapshot")
    return c


BUILDERS: list[Callable[[], Case]] = [
    junction_stored_and_loaded,
]

if __name__ == "__main__":
    sys.exit(author.main(BUILDERS, sys.argv[1:]))
