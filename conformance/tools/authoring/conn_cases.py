"""The connector corpus, ``conformance/cases/conn_*.json``, as scheduler scripts
(``tailproof.conformance.tools.authoring.author``). Each script runs on vLLM 0.33 + Mooncake
and on the reference in lockstep (strict block ids) while it is written, and vLLM's
observations become the expectations. Each description says what the case pins and why.
Over 600 lines because it is data: one short script per case.

    .venv/bin/python conformance/tools/authoring/conn_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tailproof.conformance.tools.authoring import author
from tailproof.conformance.tools.authoring.author import FA, Case, M, of, rng

RECORD = ("vllm-mooncake", "reference")


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           use_eagle: bool = False, **connector: Any) -> dict[str, Any]:
    """A config with a producer connector (``connector`` overrides its settings)."""
    eagle = {"use_eagle": True} if use_eagle else {}
    return author.config(groups, h, num_blocks, **eagle,
                         connector={"role": "producer", **connector})


def case(name: str, description: str, config_doc: dict[str, Any]) -> Case:
    return Case(name, description, config_doc, record=RECORD)


G16 = [(FA, 16, False), (M, 16, False)]  # lcm 16, h 4: partial hits on


def subblock_tail_reads_cow_target() -> Case:
    c = case("conn_subblock_tail_reads_cow_target",
             "S1/S2/W2/W5: a 13-token prompt (FA16+M16, h4) registers its Mamba tail at ck=12 and "
             "the running CoW of the 12->13 chunk hands off the CoW *target*. The store job of "
             "that "
             "step puts FA block 0 under the boundary-12 key and the Mamba state from the CoW "
             "target (never the overwritten table source); both are pinned once (the target was "
             "at ref 0 in the free queue after the retention release and is pinned before any "
             "allocation), released after the worker reports. A 16-token consumer then looks up "
             "12 tokens from the store.", config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("pool_state")
    c.op("worker_run")
    c.op("pool_state")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 13), rng(100, 103)])
    c.op("store_lookup", rid="B")
    c.op("sched_lookup", rid="B", local=0)
    return c


def smaller_group_tail_puts() -> Case:
    c = case("conn_smaller_group_tail_puts",
             "W3/E7: FA block 4 < Mamba block 16 (lcm 16, h 4). Normal saves stop at the lcm floor "
             "(0 here), so the FA blocks between floor(12,16)=0 and the boundary 12 are published "
             "as boundary puts keyed 4, 8, 12 (tail_put_range), plus the Mamba state at 12. A "
             "second request with the same prompt produces a job whose keys all exist: the worker "
             "dedupes against the store and makes no put call.",
             config([(FA, 4, False), (M, 16, False)], 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 13)])
    c.step(admit=("B",), lookup_connector=False)
    c.step(run=("B",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def null_and_mamba_never_saved_positionally() -> Case:
    c = case("conn_null_and_mamba_never_saved_positionally",
             ("I16/E10/S11: a 40-token prompt in 16-token chunks. Normal-save jobs pin every "
              "non-null block of the *current* full-attention table; Mamba blocks are pinned only "
              "as exact hand-offs (the Mamba align table holds nulls and superseded states and is "
              "never resolved positionally). Normal saves put only FA block-end keys (16, 32); "
              "Mamba keys come only from hand-offs (snapshots 16, 32 and the CoW tail at ck=36)."),
             config(G16, 4))
    c.add("A", [rng(0, 40)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("table", rid="A")
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("table", rid="A")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def pressure_gate() -> Case:
    c = case("conn_pressure_gate",
             ("W1/E9/I18: request A's first save job gets -200 (store full): the gate turns on and "
              "A joins the skip set. A's next job runs but puts nothing (its one-shot Mamba "
              "snapshot at 32 is lost for good) and still reports, so its pins are released. "
              "Request B's fully successful batch clears the gate; A's next job then saves from "
              "A's own offset 0, retrying the skipped FA range (16, 32, 48 in one batch)."),
             config(G16, 4))
    c.add("A", [rng(0, 49)])
    c.add("B", [rng(200, 217)])
    c.step(admit=("A",), budget=16)
    c.op("worker_run", store=["full"])
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.step(admit=("B",), budget=16)
    c.op("worker_run")
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def failed_boundary_put_stays_absent() -> Case:
    c = case("conn_failed_boundary_put_stays_absent",
             ("E9/I17: C's tail job (keys 12) raises in the put and A's tail job (keys 20) fails "
              "with -1: both fail closed (keys absent), neither sets the pressure gate (only -200 "
              "does), and A's normal-save offset stays at 16. Lookups then miss the tails: A's "
              "prefix falls back to the block-aligned 16 and C's (sub-block) prompt to 0."),
             config(G16, 4))
    c.add("A", [rng(0, 21)])
    c.add("C", [rng(100, 113)])
    c.step(admit=("A", "C"), budget=16)
    c.step(run=("A", "C"))
    c.step(run=("A",))
    c.op("worker_run", n=1)
    c.op("worker_run", n=1, store=["raise"])
    c.op("worker_run", store=["error"])
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 21), rng(100, 104)])
    c.op("store_lookup", rid="B")
    c.add("D", [of("C", 13), 1, 2, 3])
    c.op("store_lookup", rid="D")
    return c


def mixed_codes_partial_batch() -> Case:
    c = case("conn_mixed_codes_partial_batch",
             ("I17/I18: one tail batch (FA@36, Mamba@36) with per-key codes [ok, -200]: the FA "
              "key is "
              "stored, the Mamba key stays absent, -200 turns the gate on and skips the live "
              "request A. A lookup is then clipped to 32 because the Mamba group lacks 36."),
             config(G16, 4))
    c.add("A", [rng(0, 37)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run", n=2)
    c.op("worker_run", store=[["ok", "full"]])
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 37), 7])
    c.op("store_lookup", rid="B")
    return c


def pins_survive_preemption() -> Case:
    c = case("conn_pins_survive_preemption",
             ("S12/E3/I14: request A's save job is in flight when A is preempted: its pins are "
              "keyed by job id, so preemption does not release them (the core frees A's table; "
              "the pinned blocks stay referenced, out of the free queue). The worker retires A's "
              "ledger on the preemption, so the stale job runs not-live (no put, its one-shot "
              "Mamba snapshot at 16 is lost) yet reports, and only then are its pins released. "
              "A resumes under the same id with a fresh job id and saves from offset 0."),
             config(G16, 4))
    c.add("A", [rng(0, 33)])
    c.step(admit=("A",), budget=16)
    c.op("preempt", rid="A")
    c.op("pool_state")
    c.step(preempted=("A",))
    c.op("pool_state")
    c.step(admit=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("pool_state")
    c.op("store_keys")
    return c


def request_id_reuse() -> Case:
    c = case("conn_request_id_reuse",
             ("S12/I14: request A finishes with its first job still queued, and a new request "
              "reuses the id 'A'. Pins are keyed by job id, so each report releases only its own "
              "job's blocks, and the new generation gets a fresh job id. The worker ledger, "
              "however, is keyed by request id and retires a finished id only once its jobs "
              "drained, so the old job is still live: it puts the old prefix and writes the "
              "shared resume offset (16), and the new generation's normal save then starts at 16 "
              "and never stores its own FA block 0 (only its Mamba hand-off at 16 lands). vLLM "
              "0.33 makes engine request ids unique (input_processor.py:371 appends a random "
              "suffix), so only preemption reuses an id in practice; this pins the behaviour "
              "for a caller that bypasses that."),
             config(G16, 4))
    c.add("A", [rng(0, 17)])
    c.step(admit=("A",))
    c.op("free", rid="A")
    c.step(finished=("A",))
    c.add("A", [rng(50, 67)])
    c.step(admit=("A",))
    c.op("conn_state")
    c.op("worker_run", n=1)
    c.op("worker_report")
    c.op("pool_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [rng(50, 67), 1])
    c.op("store_lookup", rid="B")
    c.op("pool_state")
    return c


def two_workers_release_last() -> Case:
    c = case("conn_two_workers_release_last",
             "S14/I14: with two workers every job is run by both ranks (each under its own rank "
             "namespace); the pins stay after the first rank reports (remaining 1, "
             "has_pending_push_work true) and are released only when the last rank reports. A "
             "lookup needs every rank's key: with rank 1's keys missing it misses.",
             config(G16, 4, num_workers=2))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("worker_run", worker=0)
    c.op("worker_report", workers=[0])
    c.op("pool_state")
    c.add("B", [of("A", 13), 1, 2, 3])
    c.op("store_lookup", rid="B")
    c.op("worker_run", worker=1)
    c.op("worker_report", workers=[1])
    c.op("pool_state")
    c.op("store_lookup", rid="B")
    c.op("store_keys")
    return c


def finish_handoff_pinned_before_cleanup() -> Case:
    c = case("conn_finish_handoff_pinned_before_cleanup",
             "E1/S3/I13: a 13-token producer aborts right after its 12-token chunk (computed == "
             "ck, nothing in flight). The finish hook finalizes the Mamba tail (the unchanged "
             "table source), and the connector pins it plus the FA tail block *before* the core "
             "frees the request; the job rides the next connector step, its puts succeed after "
             "the request is gone, and a consumer then hits 12 from the store.",
             config(G16, 4))
    c.add("A", [rng(0, 13)], max_tokens=1)
    c.step(admit=("A",))
    c.op("conn_finish", rid="A")
    c.op("free", rid="A")
    c.op("pool_state")
    c.step(finished=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("pool_state")
    c.op("store_keys")
    c.add("B", [rng(0, 13), 9, 9, 9])
    c.op("store_lookup", rid="B")
    return c


def finish_past_boundary_no_handoff() -> Case:
    c = case("conn_finish_past_boundary_no_handoff",
             "E1/I11: a request that finishes after computing past ck (or with tokens in flight) "
             "gets no finish-time hand-off: finalize consumes the marker and returns nothing, so "
             "nothing is pinned and the connector queues no job.", config(G16, 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.op("set_in_flight", rid="A", n=1)
    c.op("conn_finish", rid="A")
    c.op("free", rid="A")
    c.step(finished=("A",))
    c.op("conn_state")
    return c


def resumed_prefill_claims_past_prompt() -> Case:
    c = case("conn_resumed_prefill_claims_past_prompt",
             ("S9/E3/E11: a 20-token prompt (ck 16, block-aligned: no sub-block tail) decodes 12 "
              "tokens; the Mamba snapshot at 32 reached in decode is offered but dropped unpinned "
              "(32 > prefill_end 20). After preemption the request re-prefills prompt+outputs "
              "(16 from the local prefix cache, then 16..32) as a resumed request whose "
              "prefill_end is 32, so the same boundary 32, past the prompt, is now claimed, "
              "pinned and saved."),
             config(G16, 4))
    c.add("A", [rng(0, 20)], max_tokens=20)
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("append_output", rid="A", tokens=[rng(300, 312)])
    c.step(run=("A",), n={"A": 12})
    c.op("worker_run")
    c.op("worker_report")
    c.op("preempt", rid="A")
    c.step(preempted=("A",))
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("pool_state")
    return c


def decode_boundary_dropped() -> Case:
    c = case("conn_decode_boundary_dropped",
             "S7/E11/I15: a 12-token prompt (ck 8 -> chunks 8, 12) decodes to 16 tokens; the core "
             "offers the aligned Mamba snapshot at 16 but 16 > prefill_end 12, so the connector "
             "drops it: no job, no pin, the block stays with ref 1 (table only).",
             config(G16, 4))
    c.add("A", [rng(0, 12)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("append_output", rid="A", tokens=[rng(40, 44)])
    c.step(run=("A",), n={"A": 4})
    c.op("pool_state")
    c.op("conn_state")
    return c


def remote_vs_local_tail() -> Case:
    c = case("conn_remote_vs_local_tail",
             "E13/S15: request B has a local sub-block hit at 20 (A's tail at ck(21)=20) whose "
             "block-aligned part is 16. With the store holding B's prefix up to 28 the remote hit "
             "strictly beats the local one: the local blocks are truncated to 16 and 12 tokens "
             "are loaded (LoadSpec 16/28). Request C's store only reaches 20: remote does not "
             "beat local, the local tail is kept and nothing is loaded.",
             config(G16, 4, role="both"))
    c.add("A", [rng(0, 21)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.add("B", [of("A", 21), rng(60, 72)])
    c.op("store_seed", rid="B", keys=[[0, 16], [0, 28], [1, 28]])
    c.step(admit=("B",))
    c.op("table", rid="B")
    c.add("C", [of("A", 21), rng(80, 92)])
    c.op("store_seed", rid="C", keys=[[0, 16], [0, 20], [1, 20]])
    c.step(admit=("C",))
    c.op("table", rid="C")
    return c


def full_external_hit_rederived() -> Case:
    c = case("conn_full_external_hit_rederived",
             "E14/S15/W7: a 48-token request whose whole prefix is in the store: the lookup first "
             "finds 48 >= num_tokens and re-derives at align(47)=44, so the last token is always "
             "recomputed; the FA tail key boundary is 44 (present). With partial hits off (h = "
             "block = 16) a 48-token request re-derives at 32.", config(G16, 4))
    c.add("A", [rng(0, 48)])
    c.op("store_seed", rid="A", keys=[[0, 16], [0, 32], [0, 44], [0, 48], [1, 16], [1, 32],
                                     [1, 44], [1, 48]])
    c.op("store_lookup", rid="A")
    c.op("sched_lookup", rid="A", local=16)
    c.op("store_lookup", rid="A", num_tokens=45)
    c.op("store_lookup", rid="A", num_tokens=44)
    return c


def full_external_hit_coarse() -> Case:
    c = case("conn_full_external_hit_coarse",
             "E14/S15: partial hits off (FA16+M16 with h=16): lookups are lcm-aligned, a "
             "48-token request fully present re-derives at align(47)=32; with a local hit of 32 "
             "nothing is loaded; a 12-token (sub-block) prompt is not looked up at all.",
             config(G16, 16))
    c.add("A", [rng(0, 48)])
    c.op("store_seed", rid="A", keys=[[0, 16], [0, 32], [0, 48], [1, 16], [1, 32], [1, 48]])
    c.op("store_lookup", rid="A")
    c.op("sched_lookup", rid="A", local=16)
    c.op("sched_lookup", rid="A", local=32)
    c.add("S", [rng(0, 12)])
    c.op("sched_lookup", rid="S", local=0)
    return c


def lookup_clipped_by_missing_group() -> Case:
    c = case("conn_lookup_clipped_by_missing_group",
             "W10/I9/I10: the hybrid store hit is the longest prefix every group can serve. With "
             "FA@16,32,44 and Mamba@16,32,44 a 45-token lookup hits 44; removing the Mamba tail "
             "@44 clips FA to 32; restoring it and removing the FA tail @44 also gives 32; with "
             "only Mamba keys nothing hits (FA misses block 0).", config(G16, 4))
    c.add("A", [rng(0, 45)])
    keys = [[0, 16], [0, 32], [0, 44], [1, 16], [1, 32], [1, 44]]
    c.op("store_seed", rid="A", keys=keys)
    c.op("store_lookup", rid="A")
    c.op("store_remove", rid="A", keys=[[1, 44]])
    c.op("store_lookup", rid="A")
    c.op("store_seed", rid="A", keys=[[1, 44]])
    c.op("store_remove", rid="A", keys=[[0, 44]])
    c.op("store_lookup", rid="A")
    c.op("store_remove", rid="A", keys=[[0, 16], [0, 32]])
    c.op("store_lookup", rid="A")
    return c


def hit_evicted_before_load() -> Case:
    c = case("conn_hit_evicted_before_load",
             "Remembered lookups (docs/connector-ops.md): C's lookup hits 32 but C is not admitted "
             "that step; FA@16 is then evicted in the middle of the prefix (a removal the store "
             "reports), so C's next lookup is asked again and misses (FA block 0 is gone). A's "
             "lookup hits 32 and is admitted; FA@32 is evicted between its lookup and its load: "
             "the step still carries the load (the spec was taken at lookup time, as in vLLM), "
             "which fails closed on impl (the value is absent, no block is written).",
             config(G16, 4))
    c.add("C", [rng(0, 48)])
    c.op("store_seed", rid="C", keys=[[0, 16], [0, 32], [1, 32]])
    c.op("new_step")
    c.op("lookup", rid="C")
    c.op("sched_lookup", rid="C")
    c.op("store_remove", rid="C", keys=[[0, 16]])
    c.op("new_step")
    c.op("lookup", rid="C")
    c.op("sched_lookup", rid="C")
    c.add("A", [rng(100, 148)])
    c.op("store_seed", rid="A", keys=[[0, 16], [0, 32], [1, 32]])
    c.op("new_step")
    c.op("lookup", rid="A")
    c.op("sched_lookup", rid="A")
    c.op("store_remove", rid="A", keys=[[0, 32]])
    c.op("plan_chunk", rid="A", use_hit=True, external=32)
    c.op("allocate", rid="A", n="plan", use_hit=True, external=32)
    c.op("drain_offloads")
    c.op("drain_copies")
    c.op("conn_step")
    c.op("commit", rid="A")
    c.op("conn_state")
    return c


def put_between_asks() -> Case:
    c = case("conn_put_between_asks",
             "Remembered lookups over a store that counts its changes (docs/connector-ops.md): "
             "C waits with the store holding FA@16 only (no Mamba state: a miss); asked again "
             "with nothing put, C misses again (impl asks the store nothing); FA@32 and the "
             "Mamba state at 32 are then put, so the next ask finds them (hit 32); an ask with "
             "nothing put since answers 32 again; a stray key of another request is put and C "
             "is asked again (a change: re-asked, still 32).", config(G16, 4))
    c.add("C", [rng(0, 48)])
    c.add("B", [rng(200, 248)])
    c.op("store_seed", rid="C", keys=[[0, 16]])
    for _ in range(2):
        c.op("new_step")
        c.op("sched_lookup", rid="C")
    c.op("store_seed", rid="C", keys=[[0, 32], [1, 32]])
    for _ in range(2):
        c.op("new_step")
        c.op("sched_lookup", rid="C")
    c.op("store_seed", rid="B", keys=[[0, 16]])
    c.op("new_step")
    c.op("sched_lookup", rid="C")
    return c


def sub_block_prompt_lookup() -> Case:
    c = case("conn_sub_block_prompt_lookup",
             "E4/S15/W5: with partial hits a 12-token prompt (shorter than one 16-token block) is "
             "looked up at hash granularity: the store holds 8 -> load 8. A 3-token prompt "
             "(shorter than h) is never looked up.", config(G16, 4))
    c.add("A", [rng(0, 12)])
    c.op("store_seed", rid="A", keys=[[0, 8], [1, 8]])
    c.op("store_lookup", rid="A")
    c.op("sched_lookup", rid="A", local=0)
    c.add("T", [rng(0, 3)])
    c.op("sched_lookup", rid="T", local=0)
    return c


def eagle_tail_puts_proof_margin() -> Case:
    c = case("conn_eagle_tail_puts_proof_margin",
             "S3/S4/E6: EAGLE (FA16 eagle + M16, h4, P=49): ck = 44 (one unit below floor(49,4)); "
             "the prompt-covering job puts the FA tail up to the proof end 48 (block 2 keyed 48) "
             "and the Mamba CoW tail at 44; a 57-token consumer's store lookup hits 44 with the FA "
             "tail key boundary 48 (the proof key).",
             config([(FA, 16, True), (M, 16, False)], 4, use_eagle=True))
    c.add("A", [rng(0, 49)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.step(run=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 49), rng(100, 108)])
    c.op("store_lookup", rid="B")
    return c


def pins_block_reset() -> Case:
    c = case("conn_pins_block_reset",
             "C10/I19: a pinned store job keeps its blocks referenced after the request is freed, "
             "so reset_prefix_cache fails; once every rank reported, the pins are released "
             "tail-first and the reset succeeds.", config(G16, 4))
    c.add("A", [rng(0, 33)])
    c.step(admit=("A",))
    c.op("free", rid="A")
    c.op("reset")
    c.op("worker_run")
    c.op("worker_report")
    c.op("pool_state")
    c.op("reset")
    return c


def tracker_save_boundaries() -> Case:
    c = case("conn_tracker_save_boundaries",
             ("S16/S17/W8: the tracker advances by the scheduled real tokens; a normal save is "
              "emitted only when the tracked length passes the next lcm boundary and covers its "
              "lcm floor (token range [saved, floor): 0-16, 16-32); the 32->36 chunk (to ck=36) "
              "makes no job; the prompt tail is published once, on the save that first covers the "
              "37-token prompt (with the FA4 tail blocks 32..36 and the Mamba CoW tail); decode "
              "steps make no jobs without save_decode_cache. FA4 keys are block-end hashes of "
              "4-token chunks (W8)."),
             config([(FA, 4, False), (M, 16, False)], 4))
    c.add("A", [rng(0, 37)])
    c.step(admit=("A",), budget=16)
    c.op("conn_state")
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("conn_state")
    c.step(run=("A",), budget=16)
    c.op("conn_state")
    c.op("append_output", rid="A", tokens=[5])
    c.step(run=("A",), n={"A": 1})
    c.op("conn_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def consumer_claims_nothing() -> Case:
    c = case("conn_consumer_claims_nothing",
             "S13/I15: a kv_consumer never claims boundary hand-offs and emits no store job, so "
             "nothing is pinned and the finish hook does not finalize.",
             config(G16, 4, role="consumer"))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("conn_finish", rid="A")
    c.op("pool_state")
    c.op("conn_state")
    return c


def aligned_prompt_two_handoffs() -> Case:
    c = case("conn_aligned_prompt_two_handoffs",
             "E5: a prompt ending exactly on a block boundary (P=16): ck = 12, so the tail at 12 "
             "(CoW target) and the aligned snapshot at 16 are both handed off; a resend of the "
             "identical prompt can only use the 12-token tail (never the full 16).",
             config(G16, 4))
    c.add("A", [rng(0, 16)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 16)])
    c.op("store_lookup", rid="B")
    return c


def multi_mamba_groups() -> Case:
    c = case("conn_multi_mamba_groups",
             "E16: two Mamba groups share the boundary; each hands off its own CoW target and "
             "both are put and pinned in one job; a lookup needs both groups' keys.",
             config([(FA, 8, False), (M, 8, False), (M, 8, False)], 4))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.step(run=("A",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 13), 1, 2, 3])
    c.op("store_lookup", rid="B")
    c.op("store_remove", rid="B", keys=[[2, 12]])
    c.op("store_lookup", rid="B")
    return c


def cow_target_not_reused() -> Case:
    c = case("conn_cow_target_not_reused",
             "I7/E18: in a small pool the running-CoW target sits at ref 0 between the retention "
             "release and the connector pin; the pin takes it out of the free queue so a filler "
             "request allocated before the job completes cannot reuse it, and the tail put still "
             "reads the right block.", config(G16, 4, num_blocks=6))
    c.add("A", [rng(0, 13)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("free", rid="A")
    c.add("F", [rng(500, 540)])
    c.step(admit=("F",), finished=("A",))
    c.op("pool_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    return c


def external_mamba_admission_undercount() -> Case:
    c = case("conn_external_mamba_admission_undercount",
             ("FINDING (vLLM 0.33 bug, reference mirrors it): FA4+M8, h2, 4 free blocks. A "
              "13-token request whose store hit is 8 (FA@4,8 + Mamba@8) is admitted with 8 "
              "external tokens and a 4-token chunk. It needs 5 blocks (FA 3; Mamba the external "
              "state block at 8 plus the running block at 12), but allocate_slots' admission "
              "check lets it through and get_new_blocks then raises ValueError ('Cannot get 1 "
              "free blocks') half-way, leaving 4 blocks allocated to the request. The scheduler "
              "expects None here (it would preempt or wait); in the engine this exception "
              "would escape Scheduler.schedule. Found by the connector property test; pinned so "
              "a fix shows."),
             config([(FA, 4, False), (M, 8, False)], 2, num_blocks=5, role="both"))
    c.add("B", [rng(0, 13)])
    c.op("store_seed", rid="B", keys=[[0, 4], [0, 8], [1, 8]])
    c.op("new_step")
    c.op("lookup", rid="B")
    c.op("sched_lookup", rid="B")
    c.op("plan_chunk", rid="B", use_hit=True, external=8)
    c.op("allocate", rid="B", n="plan", use_hit=True, external=8)
    c.op("pool_state")
    c.op("table", rid="B")
    return c


def junction_state_stored() -> Case:
    c = case("conn_junction_state_stored",
             "vLLM 0.33's shared-prefix junction on the store path: with "
             "enable_mamba_shared_prefix_checkpoint and EAGLE flagged on the Mamba group (no "
             "block drop), B shares 22 tokens with A (FA 4 + Mamba 16, h 4): its lookup hits 0 "
             "with junction 20, its first chunk stops at 20 and keys the Mamba state there; the "
             "running CoW hands the junction state off as a tail and the connector stores it "
             "with the step's saves (MooncakeStoreScheduler._handle_boundary_state_offloads). A "
             "third prompt sharing the same 22 tokens then finds the junction in the store.",
             author.config([(FA, 4), (M, 16, True)], 4, 64,
                           enable_mamba_shared_prefix_checkpoint=True,
                           connector={"role": "producer"}))
    c.add("A", [rng(0, 40)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.step(run=("A",))
    c.add("B", [of("A", 22), rng(200, 218)])
    c.step(admit=("B",))
    c.step(run=("B",))
    c.step(run=("B",))
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("C", [of("A", 22), rng(300, 318)])
    c.op("store_lookup", rid="C")
    return c


def spec_blocks_store_round_trip() -> Case:
    doc = config([(FA, 8, False), (M, 8, False)], 4, num_blocks=40, role="both")
    doc["groups"][1]["num_speculative_blocks"] = 2
    doc["max_num_scheduled_tokens"] = 16
    c = case("conn_spec_blocks_store_round_trip",
             "Mamba speculative blocks on the store path (S = 2; FA8+M8, h 4, chunks of at "
             "most 16 tokens). A 38-token prompt: its first chunk allocates the running state "
             "and two scratch blocks; the second passes two blocks, so one scratch block is "
             "moved behind a null entry (MambaManager._relocate_speculative_block) and later "
             "holds the state at ck(38) = 36. Only keyed states are handed off (16 and 32 "
             "aligned; the producer's tail at 36 at finish, from the relocated table block), "
             "never a scratch block: the store's Mamba values come from hand-offs alone "
             "(MooncakeStoreCoordinator.store_mask masks Mamba out of positional saves). With "
             "A's local keys evicted, B (same prefix) loads 32 tokens from the store into its "
             "external block and allocates its running state plus S scratch blocks.", doc)
    c.add("A", [rng(0, 38)])
    c.step(admit=("A",))
    c.step(run=("A",))
    c.op("table", rid="A")
    c.step(run=("A",))
    c.op("table", rid="A")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.steps.finish("A")
    c.step(finished=("A",))
    c.op("evict", keys=[[0, 8], [1, 16], [1, 32], [1, 36]])
    c.add("B", [of("A", 38), rng(100, 104)])
    c.step(admit=("B",))
    c.op("table", rid="B")
    c.op("pool_state")
    c.op("worker_run")
    c.op("worker_report")
    c.op("pool_state")
    return c


def window_config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
                  use_eagle: bool = False) -> dict[str, Any]:
    """``config`` where each ``sliding_window`` group gets a window of block + 1 tokens (a hit
    needs one contiguous block, two with EAGLE)."""
    doc = config(groups, h, num_blocks, use_eagle)
    for g in doc["groups"]:
        if g["kind"] == SW:
            g["sliding_window"] = g["block_size"] + 1
    return doc


SW = "sliding_window"
G_WINDOW = [(FA, 4, False), (SW, 4, False), (M, 16, False)]  # lcm 16: 4 window blocks each


def window_store_mask_skips_null_chunk() -> Case:
    c = case("conn_w01_window_store_mask_skips_null_chunk",
             "A sliding window (block 4, window 5: a hit needs 1 block) beside FA 4 and Mamba 16, "
             "h 2 (partial hits off, lcm 16). The normal save writes only the window blocks a "
             "hit at an lcm boundary can use (MooncakeStoreCoordinator.store_mask, the window's "
             "reachable_block_mask: blocks 3 and 7, keys 16 and 32), every FA block, no Mamba "
             "chunk. With the window key at 16 removed, B (A's 40 tokens + 8) hits 32 locally: "
             "its window table is null before block 7, and its save must skip the null chunk 3 "
             "that the mask keeps (KVCacheStoreSendingThread._handle_request) and put the new "
             "window block 11 (key 48). A lookup probes only masked window chunks "
             "(lookup_mask) and hits 48.",
             window_config(G_WINDOW, 2))
    c.add("A", [rng(0, 40)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.op("store_remove", rid="A", keys=[[1, 16]])
    c.add("B", [of("A", 40), rng(100, 108)])
    c.step(admit=("B",), budget=16)
    c.op("table", rid="B")
    c.step(run=("B",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("C", [of("B", 48), rng(200, 204)])
    c.op("store_lookup", rid="C")
    c.op("pool_state")
    return c


def window_tail_puts_skip_null() -> Case:
    c = case("conn_w02_window_tail_puts_skip_null",
             "The prompt tail with a sliding window (FA 4, window block 4 / window 5, Mamba 16; "
             "h 4: partial hits on, lcm 16). A's 46-token prompt caches every window block "
             "locally (the core's mask aligns on h) and the Mamba checkpoint at 44. B, the same "
             "prompt, hits 44 locally: its window table is null before block 10. B's job that "
             "publishes the tail puts FA blocks 8-10 (keys 36, 40, 44) and only window block "
             "10: _partial_tail_non_mamba_puts skips the window's null blocks 8 and 9 (a null "
             "put would trip _reference_save_blocks' assertion). C's store lookup hits 32: no "
             "Mamba state at 44 reached the store (A's tail job is due at its next step, and "
             "B's state at 44 is a local hit, never handed off).",
             window_config(G_WINDOW, 4))
    c.add("A", [rng(0, 46)])
    c.step(admit=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.step(run=("A",), budget=16)
    c.op("worker_run")
    c.op("worker_report")
    c.add("B", [of("A", 46)])
    c.step(admit=("B",))
    c.op("table", rid="B")
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("C", [of("A", 46), rng(300, 304)])
    c.op("store_lookup", rid="C")
    c.op("pool_state")
    return c


def window_eagle_store_mask_shift() -> Case:
    c = case("conn_w03_window_eagle_store_mask_shift",
             "EAGLE on a sliding window (FA 16, window block 16 / window 17, Mamba 64; h 8: "
             "partial hits off, lcm 64). A window hit with EAGLE needs two contiguous blocks "
             "and peeks one block past the boundary, so the store keeps window blocks 3-4 and "
             "7-8 (store_mask: the reachable run shifted by one; A's lcm-floored saves reach "
             "keys 64, 80 and 128) and every FA block. A lookup of A's prompt probes only those "
             "window chunks (lookup_mask) and hits 64: a hit at 128 needs block 8 too (its "
             "EAGLE peek, key 144).",
             window_config([(FA, 16, False), (SW, 16, True), (M, 64, False)], 8, 64,
                           use_eagle=True))
    c.add("A", [rng(0, 150)])
    c.step(admit=("A",), budget=64)
    c.step(run=("A",), budget=64)
    c.step(run=("A",), budget=64)
    c.op("worker_run")
    c.op("worker_report")
    c.op("store_keys")
    c.add("B", [of("A", 150), rng(400, 420)])
    c.op("store_lookup", rid="B")
    c.op("pool_state")
    return c


WINDOW: list[Callable[[], Case]] = [
    window_store_mask_skips_null_chunk, window_tail_puts_skip_null, window_eagle_store_mask_shift,
]

ALL: list[Callable[[], Case]] = [
    subblock_tail_reads_cow_target, smaller_group_tail_puts, junction_state_stored,
    null_and_mamba_never_saved_positionally, pressure_gate, failed_boundary_put_stays_absent,
    mixed_codes_partial_batch, pins_survive_preemption, request_id_reuse,
    two_workers_release_last, finish_handoff_pinned_before_cleanup,
    finish_past_boundary_no_handoff, resumed_prefill_claims_past_prompt, decode_boundary_dropped,
    remote_vs_local_tail, full_external_hit_rederived, full_external_hit_coarse,
    lookup_clipped_by_missing_group, hit_evicted_before_load, put_between_asks,
    sub_block_prompt_lookup,
    eagle_tail_puts_proof_margin,
    pins_block_reset, tracker_save_boundaries, consumer_claims_nothing,
    aligned_prompt_two_handoffs, multi_mamba_groups, cow_target_not_reused,
    external_mamba_admission_undercount, spec_blocks_store_round_trip, *WINDOW,
]


if __name__ == "__main__":
    raise SystemExit(author.main(ALL, sys.argv[1:]))
