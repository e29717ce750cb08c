"""The turn-end checkpoint extension's corpus, ``conformance/cases/conn_x*.json``, as scheduler
scripts (``tailproof.conformance.tools.authoring.author``).

The extension (``docs/reuse.md``) is not in vLLM 0.33: these cases turn it on in
``config.connector``, so the vLLM adapters refuse them (``adapters.refusal``) and they are
recorded from the reference connector model while ``impl`` runs in lockstep (strict block ids,
real KV bytes: every put and load is checked byte for byte by ``runner_sim``). Each
description says what the case pins.

    .venv/bin/python conformance/tools/authoring/reuse_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tailproof.conformance.tools.authoring import author
from tailproof.conformance.tools.authoring.author import FA, Case, M, of, rng

RECORD = ("reference", "impl")
G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           **connector: Any) -> dict[str, Any]:
    """A producer connector with turn-end checkpoints on (``connector`` overrides)."""
    return author.config(groups, h, num_blocks, connector={
        "role": "producer", "turn_end_checkpoints": True, **connector})


def case(name: str, description: str, config_doc: dict[str, Any]) -> Case:
    return Case(name, description, config_doc, record=RECORD)


def decode(c: Case, rid: str, first: int, steps: int, **step: Any) -> None:
    """``steps`` decode steps of ``rid``: each appends the token the previous forward sampled
    (``first``, ``first + 1``, ...) and computes it."""
    for i in range(steps):
        c.op("append_output", rid=rid, tokens=[first + i])
        c.step(run=(rid,), n={rid: 1}, **step)


def finish(c: Case, rid: str, last: int) -> None:
    """``rid`` samples its last token ``last`` and finishes: the finish hook, then the free
    (the next step lists it as finished)."""
    c.op("append_output", rid=rid, tokens=[last])
    c.op("conn_finish", rid=rid)
    c.op("free", rid=rid)


def two_turn_chat() -> Case:
    c = case("conn_x01_two_turn_chat_resumes_past_response",
             "Turn-end checkpoint (docs/reuse.md rules 1-3): A's 13-token prompt (FA16+M16, h4, "
             "ck 12) decodes to 22 computed tokens. The steps ending at 16 and 20 (hash "
             "boundaries past ck) copy the running Mamba state into A's one snapshot block "
             "(taken from the pool at 16, overwritten at 20). At finish the snapshot at 20 is "
             "flushed once: an offload-only job putting FA blocks 0 (key 16) and 1 (key 20) and "
             "the slot under the Mamba key 20, pinning them and dropping the connector's own "
             "reference on the slot. After the prefix cache is reset, turn 2 (A's prompt + "
             "response + a new message) looks up 20 tokens from the store (vLLM 0.33 would stop "
             "at ck 12) and loads them byte-exact (impl: runner_sim checks the loaded FA slots "
             "and the Mamba state at 20).",
             config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 9)
    c.op("conn_state")
    finish(c, "A", 509)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("B", [of("A", 13), rng(500, 510), rng(600, 606)])
    c.op("store_lookup", rid="B")
    c.step(admit=("B",))
    c.op("table", rid="B")
    c.op("pool_state")
    return c


def last_snapshot_flushed() -> Case:
    c = case("conn_x02_only_last_snapshot_flushed",
             "Rules 1-3: A (13-token prompt, ck 12) decodes to 30 computed tokens; the snapshot "
             "block taken at 16 is overwritten at 20, 24 and 28 (same slot, boundary moving "
             "with it) and only the last one is flushed, in the step that reaches it (rule 3b: "
             "28 is A's last boundary before a finish by length): the store holds Mamba keys "
             "12 (the prompt tail) and 28 only, the FA blocks keyed 16 and 28 (each block up to "
             "the boundary). A request sharing A's first 24 tokens therefore hits 12, not 24 "
             "(no Mamba state at 16, 20 or 24), while turn 2 hits 28 and loads it byte-exact "
             "(impl: the state at 28, not at 16/20/24).",
             config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 17)
    c.op("conn_state")
    finish(c, "A", 517)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("C", [of("A", 13), rng(500, 511), 7, 7])
    c.op("store_lookup", rid="C")
    c.add("B", [of("A", 13), rng(500, 518), rng(600, 604)])
    c.op("store_lookup", rid="B")
    c.step(admit=("B",))
    c.op("table", rid="B")
    return c


def slots_exhausted() -> Case:
    c = case("conn_x03_checkpoint_slots_exhausted",
             "Rule 1 bound checkpoint_slots=1: A and B (13-token prompts) decode side by side; "
             "at 16 A (scheduled first) takes the one snapshot block and B's snapshot is skipped "
             "(no copy, no block). A finishes at 18: its turn-end job pins the slot and the "
             "connector drops its reference, so no request holds a slot and B's snapshot at 20 "
             "takes a new block (the pinned one is not reused). B's flush at 22 stores the state "
             "at 20.",
             config(G16, 4, checkpoint_slots=1))
    c.add("A", [rng(0, 13)])
    c.add("B", [rng(100, 113)])
    c.step(admit=("A", "B"))
    c.step(run=("A", "B"))
    for i in range(5):
        c.op("append_output", rid="A", tokens=[500 + i])
        c.op("append_output", rid="B", tokens=[700 + i])
        c.step(run=("A", "B"), n={"A": 1, "B": 1})
    c.op("conn_state")
    finish(c, "A", 505)
    for i in range(5, 9):
        c.op("append_output", rid="B", tokens=[700 + i])
        c.step(run=("B",), n={"B": 1}, finished=("A",) if i == 5 else ())
    c.op("conn_state")
    c.op("pool_state")
    finish(c, "B", 709)
    c.step(finished=("B",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("conn_state")
    return c


def reserve_refuses_slot() -> Case:
    c = case("conn_x04_reserve_blocks_refuse_slot",
             "Rule 1 bound checkpoint_reserve_blocks=4 in a 9-block pool: with 4 free blocks, "
             "A's snapshot at 16 would leave 3 once taken, so it is skipped (no snapshot, no "
             "block taken, slots empty). When B finishes and its blocks go back to the pool, "
             "A's snapshot at 20 takes a block (5 free before), and A's finish flushes the "
             "state at 20: a later request hits 20 and loads it byte-exact.",
             config(G16, 4, num_blocks=9, checkpoint_reserve_blocks=4))
    c.add("A", [rng(0, 13)])
    c.add("B", [rng(100, 113)])
    c.step(admit=("A", "B"))
    c.step(run=("A", "B"))
    c.op("worker_run")
    c.op("worker_report")
    decode(c, "A", 500, 3)
    c.op("conn_state")
    c.op("pool_state")
    c.op("conn_finish", rid="B")
    c.op("free", rid="B")
    c.op("append_output", rid="A", tokens=[503])
    c.step(run=("A",), n={"A": 1}, finished=("B",))
    decode(c, "A", 504, 3)
    c.op("conn_state")
    finish(c, "A", 507)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("D", [of("A", 13), rng(500, 508), 9])
    c.step(admit=("D",))
    c.op("table", rid="D")
    return c


def final_snapshot_ignores_reserve() -> Case:
    c = case("conn_x13_last_boundary_snapshot_ignores_reserve",
             "Rules 1 and 3b: checkpoint_reserve_blocks=4 in a 9-block pool refuses A's rolling "
             "snapshot at 16 (3 blocks would be left), but 20 is A's last boundary before its "
             "finish by length (13-token prompt, max_tokens 8: 20 computed at the end), so that "
             "snapshot needs no reserve: it takes a block and is flushed in the same step (the "
             "job pins the block; the connector holds no slot after it). A's finish then has "
             "nothing to flush, and a later request hits 20 and loads it byte-exact.",
             config(G16, 4, num_blocks=9, checkpoint_reserve_blocks=4))
    c.add("A", [rng(0, 13)], max_tokens=8)
    c.add("B", [rng(100, 113)])
    c.step(admit=("A", "B"))
    c.step(run=("A", "B"))
    c.op("worker_run")
    c.op("worker_report")
    decode(c, "A", 500, 3)
    c.op("conn_state")
    decode(c, "A", 503, 4)
    c.op("conn_state")
    finish(c, "A", 507)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("conn_finish", rid="B")
    c.op("free", rid="B")
    c.step(finished=("B",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("reset")
    c.add("D", [of("A", 13), rng(500, 507), 9])
    c.step(admit=("D",))
    c.op("table", rid="D")
    return c


def preemption_releases_slot() -> Case:
    c = case("conn_x05_preemption_releases_slot",
             "Rule 4: A holds a snapshot block (state at 16) when it is preempted; the step "
             "listing A as preempted releases the block to the pool (slots empty, free count "
             "up). A is re-admitted (a local hit of 16) and recomputes to 18 (prompt + outputs, "
             "no hash boundary past 16); the decode step ending at 20 takes a new snapshot "
             "block, and the turn-end job puts only FA block 1 (from the resumed save at 16). "
             "A's finish flushes the state at 20, which turn 2 loads byte-exact.",
             config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 4)
    c.op("conn_state")
    c.op("append_output", rid="A", tokens=[504])
    c.op("preempt", rid="A")
    c.step(preempted=("A",))
    c.op("conn_state")
    c.op("pool_state")
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 505, 3)
    c.op("conn_state")
    finish(c, "A", 508)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("B", [of("A", 13), rng(500, 509), rng(600, 603)])
    c.step(admit=("B",))
    c.op("table", rid="B")
    return c


def finish_above_computed() -> Case:
    c = case("conn_x06_finish_snapshot_above_computed",
             "Rule 3's guard: A's step ending at 20 takes a snapshot (boundary 20) but A is "
             "aborted before that step's tokens count (no commit: 19 computed). At finish the "
             "snapshot is above the computed tokens, so there is no turn-end job: the slot is "
             "released to the pool (turn_end null, slots empty), and the store keeps only the "
             "prompt tail at 12.",
             config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 6)
    c.op("append_output", rid="A", tokens=[506])
    c.steps.begin()
    c.steps.run("A", 1)
    c.steps.end(())
    c.op("conn_state")
    c.op("conn_finish", rid="A")
    c.op("free", rid="A")
    c.op("conn_state")
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def decode_boundary_saves() -> Case:
    c = case("conn_x07_decode_boundary_saved",
             "Rule 5 (decode_boundary_saves on, turn-end checkpoints off): A's 13-token prompt "
             "decodes past 16; the core hands off the aligned Mamba state at 16, a decode "
             "boundary vLLM 0.33 drops. It is accepted: an offload-only job puts FA block 0 "
             "under key 16 (turn_end_attention_puts from the saved offset 0) before the Mamba "
             "put at 16, both pinned; the tracker's saved offset stays 0. After A finished and "
             "the prefix cache is reset, a request sharing A's first 18 tokens resumes at 16 "
             "from the store, loaded byte-exact.",
             author.config(G16, 4, 64, connector={"role": "producer",
                                                   "decode_boundary_saves": True}))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 5)
    c.op("conn_state")
    finish(c, "A", 505)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("B", [of("A", 13), rng(500, 505), 9, 9])
    c.op("store_lookup", rid="B")
    c.step(admit=("B",))
    c.op("table", rid="B")
    return c


def flush_pins_two_workers() -> Case:
    c = case("conn_x08_flush_pins_until_every_worker",
             "Rules 3 and I14 with two workers: A's turn-end job pins FA blocks and the slot, "
             "and the connector drops its own reference on the slot at finish, so the slot is "
             "held by the pin alone (refcount 1, not in the free queue). After worker 0 "
             "reports, the job still waits for one rank and the slot stays pinned; only "
             "worker 1's report releases it (the slot back in the free queue). Both ranks' "
             "keys make turn 2's lookup hit 20.",
             config(G16, 4, num_workers=2))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 8)
    finish(c, "A", 508)
    c.op("pool_state")
    c.step(finished=("A",))
    c.op("worker_run", worker=0)
    c.op("worker_report", workers=[0])
    c.op("pool_state")
    c.op("conn_state")
    c.op("worker_run", worker=1)
    c.op("worker_report", workers=[1])
    c.op("pool_state")
    c.add("B", [of("A", 13), rng(500, 509), 3])
    c.op("store_lookup", rid="B")
    return c


def pinned_slot_not_reused() -> Case:
    c = case("conn_x09_pinned_slot_not_reused",
             "Rule 3 / I14 in a 10-block pool (reserve 0): A's turn-end job holds the slot (state "
             "at 16) by its pin alone once the connector dropped its reference at finish. B's "
             "33-token prompt, admitted before the workers run, takes the free blocks but never "
             "the pinned slot, so the flush put still reads the state at 16 (impl: checked byte "
             "for byte). A slot left unpinned goes back to the pool at finish, B's forward "
             "overwrites it and the put stores B's state under A's key.",
             config(G16, 4, num_blocks=10, checkpoint_reserve_blocks=0))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    decode(c, "A", 500, 5)
    finish(c, "A", 505)
    c.add("B", [rng(300, 333)])
    c.step(admit=("B",), finished=("A",))
    c.op("pool_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def finished_without_tracker() -> Case:
    c = case("conn_x10_finished_first_releases_slot_no_tracker",
             "Rules 3-4 edge: A holds a snapshot block (state at 16) when a step lists it as "
             "finished before its finish hook ran (an order vLLM never issues). That step drops "
             "A's tracker and releases the slot (slots empty, free count up); the finish hook "
             "then finds no snapshot and no tracker: no partial tail, turn_end null, nothing "
             "pinned.",
             config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 4)
    c.op("conn_state")
    c.op("append_output", rid="A", tokens=[504])
    c.step(finished=("A",))
    c.op("conn_state")
    c.op("conn_finish", rid="A")
    c.op("free", rid="A")
    c.op("pool_state")
    return c


def lookup_waits_for_flush() -> Case:
    c = case("conn_x11_lookup_waits_for_inflight_flush",
             "Rule 7 (checkpoint_lookup_wait, impl's lookup wait, modelled by the reference): "
             "turn 2 of A arrives as A finishes, while A's turn-end job (Mamba key 20) and its "
             "prompt-tail job (key 12) are still pinned. Its connector lookup answers None "
             "(ext null): vLLM skips it this step, while an unrelated request C is admitted "
             "normally. Once the workers ran and reported, the keys are forgotten with the "
             "pins, and the next step admits turn 2: A's blocks still cached locally give 16, "
             "the store the rest up to 20 (4 tokens loaded, the Mamba state at 20 byte-exact).",
             config(G16, 4, checkpoint_lookup_wait=True))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 9)
    finish(c, "A", 509)
    c.op("reset")
    c.add("B", [of("A", 13), rng(500, 510), rng(600, 606)])
    c.add("C", [rng(300, 313)])
    c.step(admit=("B", "C"), finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.step(run=("C",), admit=("B",))
    c.op("table", rid="B")
    return c


def failed_flush_ends_the_wait() -> Case:
    c = case("conn_x12_failed_flush_ends_lookup_wait",
             "Rule 7's bound: turn 2 of A waits while A's turn-end job is pinned (ext null), "
             "then the job's put fails (-1: keys 16/20 stay absent) but it still reports, its "
             "pins are released and its keys forgotten: the next lookup is answered (the store "
             "has only the prompt tail at 12, below the local hit), and turn 2 is admitted "
             "without a load. A wait that outlived the job would skip the turn forever.",
             config(G16, 4, checkpoint_lookup_wait=True))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    decode(c, "A", 500, 9)
    finish(c, "A", 509)
    c.add("B", [of("A", 13), rng(500, 510), rng(600, 606)])
    c.step(admit=("B",), finished=("A",))
    c.op("worker_run", store=["error"])
    c.op("worker_report")
    c.op("store_keys")
    c.step(admit=("B",))
    c.op("table", rid="B")
    return c


def decode_boundary_after_decode_blocks() -> Case:
    c = case("conn_x23_decode_boundary_reads_blocks_taken_in_decode",
             "Rule 5 with FA blocks smaller than the lcm (FA4+M16, h4): A's 11-token prompt "
             "takes FA blocks 0-2; FA block 3 (tokens 12-16) is taken by a decode step, where "
             "nothing is saved. The aligned Mamba hand-off at 16 is accepted and its "
             "offload-only job puts FA blocks 0-3 under keys 4..16, block 3 included: the job "
             "reads the table as it is now, not as the last step that saved left it (a "
             "hypothesis run found impl dropping that block: it kept its table mirror only on "
             "steps that save). B, sharing 18 of A's tokens, resumes at 16 from the store.",
             author.config([(FA, 4, False), (M, 16, False)], 4, 64,
                           connector={"role": "producer", "decode_boundary_saves": True}))
    c.add("A", [rng(0, 11)])
    c.step(admit=("A",))
    c.step(run=("A",))
    decode(c, "A", 500, 7)
    c.op("conn_state")
    finish(c, "A", 507)
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("reset")
    c.add("B", [of("A", 11), rng(500, 507), 9])
    c.op("store_lookup", rid="B")
    c.step(admit=("B",))
    c.op("table", rid="B")
    return c


BUILDERS: list[Callable[[], Case]] = [
    two_turn_chat,
    last_snapshot_flushed,
    slots_exhausted,
    reserve_refuses_slot,
    preemption_releases_slot,
    finish_above_computed,
    decode_boundary_saves,
    flush_pins_two_workers,
    pinned_slot_not_reused,
    finished_without_tracker,
    lookup_waits_for_flush,
    failed_flush_ends_the_wait,
    final_snapshot_ignores_reserve,
    decode_boundary_after_decode_blocks,
]

if __name__ == "__main__":
    sys.exit(author.main(BUILDERS, sys.argv[1:]))
