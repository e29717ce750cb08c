"""The corpus cases of vLLM 0.34's rules (docs/releases.md), ``conformance/cases/*_v034.json``,
as scheduler scripts (``tailproof.conformance.tools.authoring.author``), all with
``config.vllm = "0.34"``. Two kinds:

- counterparts: a 0.33 case whose expectations differ on 0.34 (the reference observes it
  differently under ``reference/releases.py``'s switches) runs its ops again as
  ``<case>_v034``; the 0.33 file stays as it is;
- one script per 0.34 rule: resumed requests handled before running ones, the monotone saved
  offset (a missing source block retried), decode checkpoints with ``save_decode_cache`` (and
  the consumer rule), the lookup clamp, and the extension's snapshot order.

Recorded like their 0.33 peers, on vLLM 0.34 (the default ``.venv``): Mooncake cases from
``vllm-mooncake`` with the reference in lockstep, extension cases from the reference with
``impl`` in lockstep (strict ids). On another vLLM the first op the releases disagree on stops
the run (``LockstepDivergence``).

    .venv/bin/python conformance/tools/authoring/release_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from tailproof.conformance.tools.authoring import author
from tailproof.conformance.tools.authoring.author import CASES_DIR, FA, Case, M, of, rng

RELEASE = "0.34"
SUFFIX = "_v034"
MOONCAKE = ("vllm-mooncake", "reference")
EXTENSION = ("reference", "impl")
G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on
SW = "sliding_window"


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           **connector: Any) -> dict[str, Any]:
    """A 0.34 config with a producer connector (``connector`` overrides its settings)."""
    return author.config(groups, h, num_blocks, connector={"role": "producer", **connector},
                         vllm=RELEASE)


def counterpart(stem: str, record: tuple[str, ...], note: str) -> Case:
    """The 0.34 counterpart of the stored case ``stem``: its ops, ``config.vllm`` 0.34, and a
    description ending in what 0.34 does differently (``note``)."""
    doc = json.loads((CASES_DIR / f"{stem}.json").read_text())
    description = (f"{doc['description']} vLLM 0.34 counterpart of {stem} (same ops, "
                   f"expectations recorded on 0.34): {note}")
    c = Case(stem + SUFFIX, description, {**doc["config"], "vllm": RELEASE}, record)
    return c.replay(doc["ops"])


COUNTERPARTS: dict[str, tuple[tuple[str, ...], str]] = {
    "conn_refuses_foreign_handoffs": (MOONCAKE, (
        "A's preemption drops its save tracker (MooncakeStoreScheduler.build_connector_meta "
        "pops it; 0.33 resets it), so the last conn_state lists no tracker for A.")),
    "conn_w01_window_store_mask_skips_null_chunk": (MOONCAKE, (
        "B's save finds the reachable window chunk 3 null: a missing source block, so the save "
        "is not complete and B's saved offset stays at 0 (0.33 moved it to 48); the range is "
        "retried by B's next job (KVCacheStoreSendingThread._handle_request, "
        "_record_saved_offset).")),
    "conn_w02_window_tail_puts_skip_null": (MOONCAKE, (
        "B's job finds its window blocks 8 and 9 null: missing sources, so B's saved offset "
        "stays where it was (0.33 moved it; _handle_request, _record_saved_offset).")),
    "hist_56972_decode_mamba_state_not_stored": (MOONCAKE, (
        "vllm#56972 is fixed: with save_decode_cache the decode-time state at 16 is claimed "
        "(_handle_boundary_state_offloads), pinned and put by the decode save job.")),
    "conn_g02_junction_handoff_publishes_no_tail": (MOONCAKE, (
        "a preempted request's save tracker is dropped, not reset (build_connector_meta), so "
        "conn_state lists it only once the request is scheduled again.")),
    "cap_preemption_fa16-m16-h4_mooncake": (MOONCAKE, (
        "a resumed request is a new request (Scheduler.schedule: re-sent in full), handled "
        "before the running ones, so in a step that both resumes and runs requests the "
        "resumed request's store job takes the lower job id.")),
    "conn_x05_preemption_releases_slot": (EXTENSION, (
        "A's preemption drops its save tracker (0.33 resets it), so conn_state lists none "
        "for A until its re-admission.")),
    "conn_x17_preempted_before_junction": (EXTENSION, (
        "B's preemption drops its save tracker (0.33 resets it), so conn_state lists none for "
        "B until its re-admission.")),
}


# --- one case per 0.34 rule --------------------------------------------------------------

def resumed_before_running() -> Case:
    c = Case("conn_v034_resumed_before_running",
             "vLLM 0.34 (Scheduler.schedule: a resumed request is re-sent in full, like a new "
             "one): A (a 20-token prompt, 4 tokens decoded) is preempted; R (48 tokens) is "
             "admitted. In the step that runs R's second chunk and re-admits A (local hit 16), "
             "A is a new request to the connector: MooncakeStoreScheduler.build_connector_meta "
             "handles it before the running R, so A's store job gets the lower job id (0.33's "
             "Model Runner V1 lists it after the running rows: R first), and A's tracker ends "
             "its prefill at 24, the prompt plus its outputs (NewRequestData.prefill_token_ids).",
             config(G16, 4), MOONCAKE)
    c.add("A", [rng(0, 20)], max_tokens=20)
    c.step(admit=("A",), budget=16)
    c.step(run=("A",))
    c.op("append_output", rid="A", tokens=[rng(300, 304)])
    c.step(run=("A",), n={"A": 4})
    c.op("preempt", rid="A")
    c.step(preempted=("A",))
    c.add("R", [rng(1000, 1048)])
    c.step(admit=("R",), budget=16)
    c.step(run=("R",), admit=("A",), budget=16)
    c.op("conn_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


G_WINDOW = [(FA, 4, False), (SW, 4, False), (M, 16, False)]  # lcm 16: 4 window blocks each


def window_config(h: int) -> dict[str, Any]:
    """FA 4, a window of 5 tokens on 4-token blocks (a hit needs 1 block), Mamba 16."""
    doc = config(G_WINDOW, h)
    doc["groups"][1]["sliding_window"] = 5
    return doc


def missing_source_retried() -> Case:
    c = Case("conn_v034_missing_source_retried",
             "vLLM 0.34's saved offset (KVCacheStoreSendingThread._handle_request, "
             "_record_saved_offset): it moves only forward and only after a save with no failed "
             "key and no missing source block. A (40 tokens; FA 4, window 4/5, Mamba 16; h 2, "
             "lcm 16) is saved; its window key at 16 is removed. B (A's 40 tokens + 24) hits 32 "
             "locally, so its window table is null before block 7; B's Mamba states at 48 and 64 "
             "are in the store already (seeded: its boundary puts put nothing). B's first job "
             "(48) must read the reachable window chunk 3, which is null: the other keys are put "
             "but the save is incomplete, B gets no offset, and the successful put does not "
             "clear the pressure gate C's -200 opened (0.33 set B's offset to 48 and cleared "
             "it). B's next job (64) retries from 0: chunk 3 is still missing, the new keys are "
             "put, B still has no offset.",
             window_config(2), MOONCAKE)
    c.add("A", [rng(0, 40)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_remove", rid="A", keys=[[1, 16]])
    c.add("C", [rng(500, 517)])
    c.step(admit=("C",))
    c.op("worker_run", store=["full"])
    c.add("B", [of("A", 40), rng(100, 124)])
    c.op("store_seed", rid="B", keys=[[2, 48], [2, 64]])
    c.step(admit=("B",), budget=16)
    c.op("table", rid="B")
    c.op("worker_run")
    c.step(run=("B",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def decode_checkpoint_stored() -> Case:
    c = Case("conn_v034_decode_checkpoint_stored",
             "vLLM 0.34 with save_decode_cache (vllm#56972 fixed, "
             "MooncakeStoreScheduler._handle_boundary_state_offloads): A's 12-token prompt "
             "(ck 8: chunks 8, 12) decodes to 16; the core offers the aligned Mamba state at 16, "
             "past prefill_end 12, and it rides A's decode save job (FA block 0 keyed 16 from "
             "the positional save, the Mamba state at 16 as a boundary put), pinned until the "
             "worker reports. B, A's 16 tokens plus 4, then hits 16 from the store for both "
             "groups (0.33 dropped the state: B's store hit stopped at 12).",
             config(G16, 4, save_decode_cache=True), MOONCAKE)
    c.add("A", [rng(0, 12)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("append_output", rid="A", tokens=[rng(40, 44)])
    c.step(run=("A",), n={"A": 4})
    c.op("pool_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 12), rng(40, 44), rng(60, 64)])
    c.op("store_lookup", rid="B")
    return c


def hist_56972_decode_checkpoint_stored() -> Case:
    c = Case("hist_56972_decode_checkpoint_stored_v034",
             "vllm#56972 (fixed in vLLM 0.34; 0.33 has it, hist_56972_decode_mamba_state_not_"
             "stored): with save_decode_cache on, a 12-token producer prompt prefilled in one "
             "step decodes to 16; the core offers the aligned Mamba state at 16, past "
             "prefill_end 12, and MooncakeStoreScheduler._handle_boundary_state_offloads "
             "claims it: the decode conn_step's job puts it (kills "
             "ms-034-56972-decode-checkpoint-dropped, which reverts the fix) and B, A's 16 "
             "tokens plus 4, hits 16 from the store for both groups.",
             config(G16, 4, save_decode_cache=True), MOONCAKE)
    c.add("A", [rng(0, 12)])
    c.step(admit=("A",), n={"A": 12})
    c.op("append_output", rid="A", tokens=[rng(40, 44)])
    c.step(run=("A",), n={"A": 4})
    c.op("worker_run")
    c.add("B", [of("A", 12), rng(40, 44), rng(60, 64)])
    c.op("store_lookup", rid="B")
    return c


def consumer_decode_checkpoints_only() -> Case:
    c = Case("conn_v034_consumer_decode_checkpoints_only",
             "vLLM 0.34's consumer rule (MooncakeStoreScheduler._handle_boundary_state_offloads, "
             "reached when save_decode_cache is on): a consumer stores decode-time Mamba "
             "checkpoints and never prompt ones. A consumer's 13-token prompt (ck 12) hands off "
             "its sub-block tail at 12: offered, not claimed, nothing pinned. Decoding to 16 "
             "hands off the aligned state at 16, past prefill_end 13: claimed and put with the "
             "decode save (0.33 claims no hand-off for a consumer).",
             config(G16, 4, role="consumer", save_decode_cache=True), MOONCAKE)
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("append_output", rid="A", tokens=[rng(40, 43)])
    c.step(run=("A",), n={"A": 3})
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def snapshot_order_resumed_first() -> Case:
    c = Case("conn_x23_v034_snapshot_order_resumed_first",
             "Turn-end rule 1's snapshot order on vLLM 0.34 (docs/reuse.md): snapshots are "
             "taken in the order the connector handles the step's requests, and 0.34 hands a "
             "resumed request over as a new one, before the running ones (0.33: resumed rows "
             "after the running ones). A and R (13-token prompts, ck 12) decode one token a "
             "step, each taking a snapshot at 16 and 20. A is preempted at 20 (its slot "
             "released, rule 4); R runs on. In the step where R's decode ends at 24, A is "
             "re-admitted (local hit 16) with a 4-token chunk ending at 20: both take a "
             "snapshot, A's listed first, in a fresh slot, R's in the slot it holds.",
             author.config(G16, 4, 64, connector={"role": "producer",
                                                  "turn_end_checkpoints": True},
                           vllm=RELEASE), EXTENSION)
    c.add("A", [rng(0, 13)], max_tokens=20)
    c.add("R", [rng(1000, 1013)], max_tokens=20)
    c.step(admit=("A", "R"))
    c.step(run=("A", "R"))
    for i in range(7):  # 13 -> 20
        c.op("append_output", rid="A", tokens=[300 + i])
        c.op("append_output", rid="R", tokens=[400 + i])
        c.step(run=("A", "R"), n={"A": 1, "R": 1})
    c.op("conn_state")
    c.op("append_output", rid="A", tokens=[307])
    c.op("preempt", rid="A")
    c.op("append_output", rid="R", tokens=[407])
    c.step(run=("R",), n={"R": 1}, preempted=("A",))
    for i in range(8, 10):  # 21 -> 23
        c.op("append_output", rid="R", tokens=[400 + i])
        c.step(run=("R",), n={"R": 1})
    c.op("append_output", rid="R", tokens=[410])
    c.step(run=("R",), admit=("A",), n={"R": 1, "A": 4})
    c.op("conn_state")
    return c


def _counterparts() -> list[Callable[[], Case]]:
    return [partial(counterpart, stem, record, note)
            for stem, (record, note) in COUNTERPARTS.items()]


ALL: list[Callable[[], Case]] = [
    *_counterparts(), resumed_before_running, missing_source_retried, decode_checkpoint_stored,
    hist_56972_decode_checkpoint_stored, consumer_decode_checkpoints_only,
    snapshot_order_resumed_first,
]


if __name__ == "__main__":
    raise SystemExit(author.main(ALL, sys.argv[1:]))
