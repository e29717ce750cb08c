"""The junction checkpoint extension's corpus (``docs/junctions.md``, "The extension"),
``conformance/cases/conn_x14``-``conn_x22``, as scheduler scripts
(``tailproof.conformance.tools.authoring.author``).

Junction checkpoints are not in vLLM 0.33: these cases turn ``junction_checkpoints`` on in
``config.connector``, so the vLLM adapters refuse them and they are recorded from the reference
connector model (``reference/connector/junctions.py``) while ``impl`` runs in lockstep (strict
block ids, real KV bytes). Both adapters apply the scheduler hook (``Scheduler.
mamba_shared_prefix_checkpoint``), so a chunk stops exactly at a junction the connector set.
Each description says what the case pins.

    .venv/bin/python -m tailproof.conformance.tools.authoring.conn_junction_cases \
        [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tailproof.conformance.tools.authoring import author
from tailproof.conformance.tools.authoring.author import FA, Case, M, of, rng

RECORD = ("reference", "impl")
G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on
# Attention blocks smaller than the Mamba block (issue 22's agent workload: 16 under 1,024):
# vLLM's own junction then lies on the attention grid, off the Mamba grid.
G4 = [(FA, 4, False), (M, 16, False)]


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           **connector: Any) -> dict[str, Any]:
    """A producer connector with junction checkpoints on (``connector`` overrides)."""
    return author.config(groups, h, num_blocks, connector={
        "role": "producer", "junction_checkpoints": True, **connector})


def case(name: str, description: str, config_doc: dict[str, Any]) -> Case:
    return Case(name, description, config_doc, record=RECORD)


def work(c: Case, workers: int = 1) -> None:
    """Every worker runs its queued jobs, then all report."""
    for w in range(workers):
        c.op("worker_run", worker=w)
    c.op("worker_report")


def prefill_a(c: Case, workers: int = 1) -> None:
    """A's 30-token prompt in its three planned chunks (16, ck 28, 30), its jobs run."""
    c.add("A", [rng(0, 30)])
    c.prefill("A", 3)
    work(c, workers)


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
    c.op("pool_state")
    return c


def junction_sets_nothing() -> Case:
    c = case("conn_x15_junction_sets_nothing",
             "Where the connector sets no junction (docs/junctions.md, extension rule 2): X, B "
             "and C ask in one step whose 4-token budget schedules none of them (the split "
             "leaves no chunk), X first, so B and C find X's prompt in the index while nothing "
             "of X is cached; they are admitted in the next step (hits 0; C's local lookup sees "
             "the first block B just allocated: vLLM's own junction 16). B shares X's first 33 "
             "tokens: junction 32, on the Mamba grid of 16 (an aligned state, handed off "
             "anyway): no stop. C's whole 25-token prompt is X's first 25 "
             "tokens: its junction is capped at (P - 1) // h blocks = 24 = ck(P), vLLM's own "
             "tail stop: none either. Then A (30 tokens) is prefilled and D, sharing A's first "
             "29 tokens, finds its junction 28 off the grid but not past its local hit 28 (A's "
             "prompt tail): none. Every sched_lookup reports junction 0, no stop is pending "
             "(conn_state 'junctions' empty), no snapshot and no junction job.",
             config(G16, 4))
    c.add("X", [rng(1000, 1040)])
    c.add("B", [of("X", 33), rng(2000, 2007)])
    c.add("C", [of("X", 25)])
    c.step(admit=("X", "B", "C"), budget=4)
    c.step(admit=("B", "C"))
    c.op("conn_state")
    prefill_a(c)
    c.add("D", [of("A", 29), rng(300, 311)])
    c.step(admit=("D",))
    c.op("conn_state")
    return c


def reserve_refuses_junction_job() -> Case:
    c = case("conn_x16_reserve_refuses_junction_job",
             "checkpoint_reserve_blocks bounds the junction job (extension rule 3): as in "
             "conn_x14 B's chunk stops at its junction 20, but taking one fresh block would "
             "leave fewer than the 60 reserved free blocks, so the step has no snapshot and no "
             "junction job (only B's normal save); the stop is spent. C then finds only A's "
             "keys in the store (hit 16, its local hit): nothing to load, and C's own junction "
             "20 is set and stops its chunk too.",
             config(G16, 4, checkpoint_reserve_blocks=60))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("conn_state")
    work(c)
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    return c


def preempted_before_junction() -> Case:
    c = case("conn_x17_preempted_before_junction",
             "A pending junction stop dies with the request's state (extension rules 1-2): L "
             "(50 tokens) is prefilled (Mamba state cached at 48 only). B shares L's first 38 "
             "tokens: hit 0, vLLM's own junction 32 (L's attention blocks), the connector's "
             "junction 36 (9 whole hash blocks, below ck 44), set. A 16-token budget ends B's "
             "first chunk at 16, so the stop stays pending (conn_state 'junctions'). B is "
             "preempted before reaching it: the pending stop is dropped. B's re-admission asks "
             "again: the junction (computed once, at B's first ask) is set again past the new "
             "local hit 16; B's chunks stop at 32 (the last cacheable block) and then exactly "
             "at 36, where the junction job stores the state. C, sharing the same 38 tokens, "
             "hits 32 locally and loads 36 from the store byte-exact.",
             config(G16, 4))
    c.add("L", [rng(0, 50)])
    c.prefill("L", 2)
    work(c)
    c.add("B", [of("L", 38), rng(200, 210)])
    c.step(admit=("B",), budget=16)
    c.op("conn_state")
    c.op("preempt", rid="B")
    c.step(preempted=("B",))
    c.op("conn_state")
    c.step(admit=("B",))
    c.op("conn_state")
    c.step(run=("B",))
    c.op("conn_state")
    work(c)
    c.op("store_keys")
    c.add("C", [of("L", 38), rng(300, 310)])
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    return c


def junction_pins_two_workers() -> Case:
    c = case("conn_x18_junction_pins_until_every_worker",
             "Two workers (extension rule 3, I7): B's junction job pins FA block 1 and the "
             "fresh Mamba copy; the connector's own reference on the copy is dropped in the "
             "step, so the job's pin is the copy's only holder. Worker 0 runs and reports: the "
             "job is still held (one rank left) and the copy not free. Worker 1 reports: the "
             "pins are released and the copy returns to the free queue. C then loads the "
             "junction state from both ranks byte-exact.",
             config(G16, 4, num_workers=2))
    prefill_a(c, workers=2)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("pool_state")
    c.op("worker_run", worker=0)
    c.op("worker_report", workers=[0])
    c.op("pool_state")
    c.op("conn_state")
    c.op("worker_run", worker=1)
    c.op("worker_report", workers=[1])
    c.op("pool_state")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    return c


def lookup_waits_for_junction_job() -> Case:
    c = case("conn_x19_lookup_waits_for_junction_job",
             "Rule 7 over junction jobs (checkpoint_lookup_wait): B's junction job (Mamba key "
             "20) is pinned and not yet run when C, sharing the same 22 tokens, asks: C's prompt "
             "extends the in-flight key past its hit 16, so the lookup answers null and C is "
             "skipped this step. Once the workers ran and reported, the key is forgotten with "
             "the pins; the next step admits C with the store's 20 (4 tokens loaded, the Mamba "
             "state at 20 byte-exact).",
             config(G16, 4, checkpoint_lookup_wait=True))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.add("C", [of("A", 22), rng(300, 318)])
    c.step(run=("B",), admit=("C",))
    c.op("conn_state")
    work(c)
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    return c


def junction_at_vllm_junction_unkeyed() -> Case:
    c = case("conn_x20_vllm_junction_unkeyed_stored",
             "vLLM's own junction, unkeyed, is stored (docs/junctions.md, extension rule 2): "
             "attention blocks of 4 under Mamba blocks of 16 (h 4, no EAGLE group). A (30 "
             "tokens) is prefilled. B shares A's first 22 tokens: its local attention hit is 20 "
             "(5 blocks), its Mamba hit 16, so vLLM reconciles to 16 and marks its own junction "
             "20 (sched_lookup 'junction'); the connector's junction is the same 20. vLLM's "
             "split stops B's chunk exactly there (the hook) but MambaManager keys no state at "
             "it (no EAGLE group): the connector takes the junction job -- a copy of B's running "
             "state and a job putting FA block 4 and the copy under key 20. C shares the same "
             "22 tokens: local hit 16, the store's 20; it loads the 4 tokens and the Mamba "
             "state at 20 byte-exact.",
             config(G4, 4, 96))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("conn_state")
    work(c)
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    c.op("pool_state")
    return c


def device_junction_keyed() -> Case:
    c = case("conn_x21_device_junction_keyed",
             "Device junctions (docs/junctions.md, 'Device junctions'): x20's requests with "
             "device_junctions on, so the hook also sets the managers' junction keying "
             "(KVCacheManager.mamba_shared_prefix_checkpoint, no EAGLE group). B's chunk stops "
             "at vLLM's own junction 20 and MambaManager keys its state there itself: the "
             "connector takes no junction job (no copies in the step's meta); B's next chunk "
             "copies the keyed block (CoW) and hands it off as a boundary state, stored under "
             "key 20 with FA block 4. C shares the 22 tokens and hits 20 on the device.",
             config(G4, 4, 96, device_junctions=True))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("conn_state")
    work(c)
    c.step(run=("B",))
    work(c)
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    c.op("pool_state")
    return c


def device_keyed_store_side_junction() -> Case:
    c = case("conn_x22_device_keyed_store_side_junction",
             "Device junctions at the connector's own junction (docs/junctions.md, 'Device "
             "junctions'): x14's requests (FA16+M16, h4) with device_junctions on. B's junction "
             "20 is store-side (vLLM marks none: attention keys no block there); the connector "
             "sets B's shared_prefix_boundary to 20 and the chunk stops there; MambaManager, "
             "keying at the request's junction through the hook, keys the state itself and B's "
             "next chunk hands it off (CoW). 20 is off FA's 16-block grid, so the hand-off "
             "carries no attention KV up to it and the connector still takes the junction job "
             "(FA block 1 and a copy under key 20). C shares the 22 tokens and loads 20 from "
             "the store.",
             config(G16, 4, device_junctions=True))
    prefill_a(c)
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.op("conn_state")
    work(c)
    c.step(run=("B",))
    work(c)
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    c.op("pool_state")
    return c


BUILDERS: list[Callable[[], Case]] = [
    junction_stored_and_loaded,
    junction_sets_nothing,
    reserve_refuses_junction_job,
    preempted_before_junction,
    junction_pins_two_workers,
    lookup_waits_for_junction_job,
    junction_at_vllm_junction_unkeyed,
    device_junction_keyed,
    device_keyed_store_side_junction,
]

if __name__ == "__main__":
    sys.exit(author.main(BUILDERS, sys.argv[1:]))
