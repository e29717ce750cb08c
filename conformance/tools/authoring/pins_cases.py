"""tailproof's pin rules' corpus, ``conformance/cases/conn_rp*.json``, as scheduler scripts
(``tailproof.conformance.tools.authoring.author``).

Readable pins and the pin budget (``reference/connector/scheduler.py``, DEVIATIONS) are not in
vLLM 0.33: these cases set them in ``config.connector``, so the vLLM adapters refuse them
(``adapters.refusal``) and they are recorded from the reference connector model while ``impl``
runs in lockstep (strict block ids, real KV bytes checked by ``runner_sim``). Each description
says what the case pins.

    .venv/bin/python conformance/tools/authoring/pins_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tailproof.conformance.tools.authoring import author
from tailproof.conformance.tools.authoring.author import FA, Case, M, rng

RECORD = ("reference", "impl")
G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on


def config(num_blocks: int = 64, **connector: Any) -> dict[str, Any]:
    """A producer connector with readable pins on (``connector`` overrides)."""
    return author.config(G16, 4, num_blocks, connector={
        "role": "producer", "readable_pins": True, **connector})


def case(name: str, description: str, config_doc: dict[str, Any]) -> Case:
    return Case(name, description, config_doc, record=RECORD)


def readable_pins_new_blocks() -> Case:
    c = case("conn_rp01_readable_pins_new_blocks_only",
             "Readable pins, the normal path: A's 64-token prompt prefills in 16-token chunks "
             "(FA16+M16, h4). Job 0 saves [0,16) and pins FA block 0 (and the Mamba hand-off "
             "at 16). Job 1 is built before job 0 was reported, so no rank has confirmed an "
             "offset: it pins FA blocks 0 and 1 (floor 0; vLLM 0.33 pins the whole table). After "
             "both run and report offset 32, job 2 pins only FA block 2 (floor = its start 32) "
             "and its Mamba hand-off: the pins do not grow with the prompt.",
             config())
    c.add("A", [rng(0, 64)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.step(run=("A",), budget=16)
    c.op("conn_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def failed_put_widens_pins() -> Case:
    c = case("conn_rp02_failed_put_widens_pins",
             "Readable pins after a failed put: A's job 0 (normal save [0,16)) fails -- its "
             "first batch, the Mamba hand-off at 16, answers -1, which also skips the normal "
             "save -- so the rank's saved offset stays 0 and its report says so. "
             "Job 1 ([16,32)) then pins "
             "from offset 0 -- FA blocks 0 and 1, not only the new block 1 -- because the rank "
             "resumes from its own offset and re-saves key 16 with key 32 (one batch). Job 2, "
             "after offset 32 was reported, pins block 2 alone. Pinning only [start, end) here "
             "would let the rank read block 0 unpinned.",
             config())
    c.add("A", [rng(0, 49)])
    c.step(admit=("A",), budget=16)
    c.op("worker_run", store=["error"])
    c.op("worker_report")
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def lagging_rank_widens_pins() -> Case:
    c = case("conn_rp03_lagging_rank_widens_pins",
             "Readable pins with two ranks: job 0 succeeds on rank 0 and fails on rank 1 (its "
             "Mamba hand-off put answers -1, skipping the normal save), so the ranks report "
             "offsets 16 and 0 and the lowest, 0, counts. Job 1 pins "
             "FA blocks 0 and 1 (rank 1 re-saves from 0); once both ranks report 32, job 2 pins "
             "block 2 alone. Pins are released only after the second rank reported.",
             config(num_workers=2))
    c.add("A", [rng(0, 49)])
    c.step(admit=("A",), budget=16)
    c.op("worker_run", worker=0)
    c.op("worker_run", worker=1, store=["error"])
    c.op("worker_report", workers=[0])
    c.op("worker_report", workers=[1])
    c.step(run=("A",), budget=16)
    c.op("worker_run", worker=0)
    c.op("worker_run", worker=1)
    c.op("worker_report")
    c.step(run=("A",), budget=16)
    c.op("worker_run", worker=0)
    c.op("worker_run", worker=1)
    c.op("worker_report")
    c.op("store_keys")
    return c


def pin_budget_skips_job() -> Case:
    c = case("conn_rp04_pin_budget_skips_job",
             "Pin budget: a 32-block pool with pin_budget_fraction 0.25 lets store jobs hold "
             "int(0.25 * 31) = 7 blocks. A's first 64-token chunk pins 5 blocks (FA 0-3 and the "
             "Mamba hand-off at 64); B's job, built while A's is unreported, would pin 5 more and "
             "is skipped (no job id, nothing emitted: a future miss, never wrong bytes). After "
             "A's job reported, B's next job saves from B's offset 0 (readable pins: its "
             "floor is 0, no rank confirmed more) and pins within the budget.",
             config(32, pin_budget_fraction=0.25))
    c.add("A", [rng(0, 69)])
    c.add("B", [rng(300, 369)])
    c.step(admit=("A",), budget=64)
    c.step(admit=("B",), run=("A",), n={"A": 4}, budget=68)
    c.op("conn_state")
    c.op("worker_run")
    c.op("worker_report")
    c.step(run=("A", "B"), n={"A": 1, "B": 5})
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


BUILDERS: list[Callable[[], Case]] = [
    readable_pins_new_blocks,
    failed_put_widens_pins,
    lagging_rank_widens_pins,
    pin_budget_skips_job,
]

if __name__ == "__main__":
    sys.exit(author.main(BUILDERS, sys.argv[1:]))
