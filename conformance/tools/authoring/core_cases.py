"""The core (``KVCacheManager``-level) cases of the corpus, ``conformance/cases/core_*.json``,
as scheduler scripts (``tailproof.conformance.tools.authoring.author``).

The scripts are written without running; record their expectations from vLLM 0.33 with
``tailproof expect conformance/cases/core_*.json --adapters vllm --in-place`` and review them before
committing (the author keeps reviewed expectations while a case's ops are unchanged). Steps
follow the scheduler's order (``tailproof.conformance.harness.steps``): new step, lookup, plan (the
Mamba-aligned split), allocate, drain hand-offs, drain copies and free their retention at
once (``defer_block_free`` off), commit.

    .venv/bin/python scripts/author_core_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys

from tailproof.conformance.tools.authoring.author import FA, Case, M, config, main

P7 = [0, 0, 1, 1, 2, 2, 9]
C1 = config([(FA, 2), (M, 4)], 2, 20)
C24 = config([(FA, 2), (M, 4)], 2, 24)


def c01() -> Case:
    c = Case("core_c01_producer_subblock_tail",
             "C1/E1: a 7-token producer is split 4,6,7 by the scheduler; the chunk ending at "
             "ck(7)=6 registers a sub-block Mamba tail, the next chunk's running CoW moves its key"
             " to a fresh block and hands off that CoW target (never the overwritten source); a "
             "decode token later offers the aligned snapshot at 8; free returns blocks reversed.",
             C1)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("pool_state")
    c.op("finalize_tail", rid="r0")
    c.op("append_output", rid="r0", tokens=[5])
    c.step(run=("r0",), n={"r0": 1})
    c.op("free", rid="r0")
    c.op("pool_state")
    return c


def c02() -> Case:
    c = Case("core_c02_consumer_hits_cow_target",
             "C2: a consumer sharing 6 tokens of the C1 producer hits 6 (FA [1,2,4], Mamba [null, "
             "cow target]); its first allocation privatises the shared tail with a "
             "first-allocation CoW and hands off its own aligned snapshot at 8.",
             C1)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("append_output", rid="r0", tokens=[5])
    c.step(run=("r0",), n={"r0": 1})
    c.op("free", rid="r0")
    c.add("r1", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.prefill("r1", 2)
    c.op("pool_state")
    c.op("free", rid="r1")
    c.op("pool_state")
    return c


def c03() -> Case:
    c = Case("core_c03_same_step_deferral",
             "C3/E8: a key moved by a running CoW in this step is not consumable in the same step "
             "(allocate returns None, the copy has not run yet); the next step the hit succeeds.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("new_step")
    c.op("plan_chunk", rid="r0")
    c.op("allocate", rid="r0", n="plan")
    c.op("commit", rid="r0")
    c.add("r1", [0, 0, 1, 1, 2, 2, 3, 3])
    c.op("lookup", rid="r1")
    c.op("allocate", rid="r1", n=2, use_hit=True)
    c.op("drain_offloads")
    c.op("drain_copies")
    c.op("release_retained")
    c.prefill("r1", 1)
    c.op("pool_state")
    return c


def c04() -> Case:
    c = Case("core_c04_finish_at_boundary",
             "C4/E1: a producer aborted with num_computed == ck(P) and nothing in flight hands off"
             " its unchanged table source through finalize; a second finalize returns nothing.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("finalize_tail", rid="r0")
    c.op("finalize_tail", rid="r0")
    c.op("free", rid="r0")
    c.op("pool_state")
    return c


def c05() -> Case:
    c = Case("core_c05_finish_past_boundary",
             "C4/E1: once computation advanced past ck(P) the table block no longer holds the "
             "state at the boundary, so finalize consumes the marker with no hand-off.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("new_step")
    c.op("plan_chunk", rid="r0")
    c.op("allocate", rid="r0", n="plan")
    c.op("commit", rid="r0")
    c.op("finalize_tail", rid="r0")
    c.op("free", rid="r0")
    c.op("pool_state")
    return c


def c06() -> Case:
    c = Case("core_c06_finish_with_tokens_in_flight",
             "C4/E1: with tokens in flight (async scheduling) the boundary state may be "
             "overwritten, so finalize returns nothing even at the boundary.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("set_in_flight", rid="r0", n=2)
    c.op("finalize_tail", rid="r0")
    c.op("set_in_flight", rid="r0", n=0)
    c.op("finalize_tail", rid="r0")
    c.op("free", rid="r0")
    return c


def c07() -> Case:
    c = Case("core_c07_equal_block_sizes",
             "C5: FA and Mamba both 4 tokens, h=2: the producer hands off (1,*,4) then the CoW "
             "tail at 6; a 9-token consumer hits 6 and CoWs both groups' partial blocks.",
             config([(FA, 4), (M, 4)], 2, 24))
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.add("r1", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.prefill("r1", 2)
    c.op("pool_state")
    return c


def c08() -> Case:
    c = Case("core_c08_subblock_prompt_fa4_m16",
             "C6/E4: h=4, FA 4, Mamba 16: a 13-token prompt (less than one Mamba block) publishes "
             "a tail at 12; a 16-token consumer hits 12, a resend of 13 hits 12, a 12-token prompt"
             " hits 0 (the last token is always recomputed), a 3-token prompt has no hash.",
             config([(FA, 4), (M, 16)], 4, 40))
    c.add("p", [{"range": [0, 13]}])
    c.prefill("p", 2)
    c.add("c", [{"prompt_of": "p", "n": 12}, 50, 51, 52, 53])
    c.prefill("c", 1)
    c.add("resend", [{"prompt_of": "p", "n": 13}])
    c.op("lookup", rid="resend")
    c.add("twelve", [{"prompt_of": "p", "n": 12}])
    c.op("lookup", rid="twelve")
    c.add("three", [0, 1, 2])
    c.op("lookup", rid="three")
    c.op("pool_state")
    return c


def c09() -> Case:
    c = Case("core_c09_eagle_h4_fa16_m16",
             "C7/E6: with EAGLE, ck(49)=44 (one hash unit below floor(P/h)*h); the split stops at "
             "32, 44, 48, 49; a 57-token consumer and a resend both hit 44, never the proof key.",
             config([(FA, 16, True), (M, 16)], 4, 40, use_eagle=True))
    c.add("p", [{"range": [0, 49]}])
    c.prefill("p", 4)
    c.add("c", [{"prompt_of": "p", "n": 49}, {"fill": 7, "n": 8}])
    c.op("lookup", rid="c")
    c.add("r", [{"prompt_of": "p", "n": 49}])
    c.op("lookup", rid="r")
    c.op("pool_state")
    return c


def c10() -> Case:
    c = Case("core_c10_block_aligned_prompt_one_chunk",
             "C8/E5/T15: a 4-token prompt (exactly one block) prefilled in one chunk hands off "
             "only the aligned snapshot at 4; a resend can hit at most 3 floored to 2, which needs"
             " the tail at 2 that a one-chunk prefill never registers, so it hits 0.",
             config([(FA, 4), (M, 4)], 2, 24))
    c.add("p", [0, 0, 1, 1])
    c.step(admit=("p",), n={"p": 4})
    c.op("append_output", rid="p", tokens=[3])
    c.step(run=("p",), n={"p": 1})
    c.add("r", [0, 0, 1, 1])
    c.op("lookup", rid="r")
    c.op("pool_state")
    return c


def c11() -> Case:
    c = Case("core_c11_block_aligned_prompt_split",
             "E5: an 8-token prompt with 4-token blocks is split 4,6,8 (ck(8)=6), so it hands off "
             "the aligned snapshot at 4, the sub-block CoW tail at 6 and the aligned one at 8; a "
             "resend of the same 8 tokens then hits 6.",
             config([(FA, 4), (M, 4)], 2, 24))
    c.add("p", [{"range": [0, 8]}])
    c.prefill("p", 3)
    c.add("r", [{"prompt_of": "p", "n": 8}])
    c.op("lookup", rid="r")
    c.op("pool_state")
    return c


def c12() -> Case:
    c = Case("core_c12_evict_unpinned_cow_target",
             "C9/E18: without a connector pin the running-CoW target is a cache-only block at ref "
             "0 at the LRU tail; a 20-token filler in a 12-block pool reuses it and the sub-block "
             "hit is lost (hit 0).",
             config([(FA, 2), (M, 4)], 2, 12))
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("free", rid="r0")
    c.add("f", [{"range": [100, 120]}])
    c.op("lookup", rid="f")
    c.op("allocate", rid="f", n=20, use_hit=True)
    c.op("free", rid="f")
    c.add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.op("lookup", rid="c")
    c.op("pool_state")
    return c


def c13() -> Case:
    c = Case("core_c13_reset_needs_all_free",
             "C10/I19: reset_prefix_cache fails while any block is held (a live request), and "
             "succeeds once everything is free, dropping every key so the next lookup misses.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("reset")
    c.op("free", rid="r0")
    c.op("reset")
    c.add("r1", P7)
    c.op("lookup", rid="r1")
    c.op("pool_state")
    return c


def c14() -> Case:
    c = Case("core_c14_reset_blocked_by_retention",
             "I8/I19: an undrained or unreleased CoW retention holds both endpoints, so reset "
             "fails until the retention is released.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("new_step")
    c.op("plan_chunk", rid="r0")
    c.op("allocate", rid="r0", n="plan")
    c.op("commit", rid="r0")
    c.op("free", rid="r0")
    c.op("drain_copies")
    c.op("reset")
    c.op("release_retained")
    c.op("reset")
    c.op("pool_state")
    return c


def c15() -> Case:
    c = Case("core_c15_preempt_and_resume",
             "E3/T19: bs=h=8: a prompt of 8 hands off its snapshot at 8; decode 8 tokens; after "
             "preemption the resumed request re-prefills prompt+outputs and the core offers the "
             "boundary at 16, past the prompt.",
             config([(FA, 8), (M, 8)], 8, 16))
    c.add("p", [{"range": [0, 8]}])
    c.prefill("p", 1)
    c.op("append_output", rid="p", tokens=[{"range": [20, 28]}])
    for _ in range(7):
        c.step(run=("p",), n={"p": 1})
    c.op("preempt", rid="p")
    c.op("pool_state")
    c.prefill("p", 1)
    c.op("pool_state")
    return c


def c16() -> Case:
    c = Case("core_c16_freed_before_drain",
             "E2: a request freed before the step's hand-offs are drained loses them (no offload "
             "for a freed request), but its pending CoW copy still runs and holds both endpoints "
             "until the retention is released.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("new_step")
    c.op("plan_chunk", rid="r0")
    c.op("allocate", rid="r0", n="plan")
    c.op("free", rid="r0")
    c.op("drain_offloads")
    c.op("pool_state")
    c.op("drain_copies")
    c.op("release_retained")
    c.op("pool_state")
    return c


def c17() -> Case:
    c = Case("core_c17_external_hit_same_block_running_cow",
             "E12/T20 (#51766): a request whose table was filled by an external load and whose "
             "continuation needs no new Mamba block is still marked allocated, so its tail CoW is "
             "a running CoW (source kept, key moved to the copy).",
             config([(FA, 8), (M, 8)], 2, 24))
    c.add("p", [{"range": [0, 15]}])
    c.step(admit=("p",), external={"p": 10})
    c.step(run=("p",))
    c.op("pool_state")
    c.op("finalize_tail", rid="p")
    return c


def c18() -> Case:
    c = Case("core_c18_three_mamba_groups",
             "E16/T18: one hand-off per Mamba group with the same boundary (groups 1, 2, 3).",
             config([(FA, 8), (M, 8), (M, 8), (M, 8)], 8, 32))
    c.add("p", [{"range": [0, 16]}])
    c.step(admit=("p",), n={"p": 8})
    c.step(run=("p",), n={"p": 8})
    c.op("pool_state")
    return c


def c19() -> Case:
    c = Case("core_c19_smaller_fa_group",
             "E7: FA 4 + Mamba 16, h 4: the consumer hits 12 with three FA blocks and the Mamba "
             "CoW target; blocks of the smaller group inside the Mamba block are all adopted.",
             config([(FA, 4), (M, 16)], 4, 40))
    c.add("p", [{"range": [0, 13]}])
    c.prefill("p", 2)
    c.add("c", [{"prompt_of": "p", "n": 12}, 60, 61, 62, 63, 64])
    c.prefill("c", 2)
    c.op("pool_state")
    return c


def c20() -> Case:
    c = Case("core_c20_split_t1_budget",
             "T1: bs 512, h 32, budget 8192, P=10000: chunks 8192, 1536, 256 (tail stop at "
             "ck=9984), 16.",
             config([(FA, 512), (M, 512)], 32, 64))
    c.add("p", [{"range": [0, 10000]}])
    c.prefill("p", 4)
    c.op("finalize_tail", rid="p")
    return c


def c21() -> Case:
    c = Case("core_c21_split_t2_block_exceeds_budget",
             "T2: a 11392-token Mamba block larger than the 8192-token budget advances sub-block "
             "and re-aligns at the next boundary: [8192, 3200, 8192, 3200], then the tail stop at "
             "ck(30000)=29952 cuts the last chunk to 7168 (upstream T2 has partial hits off: "
             "7216).",
             config([(FA, 11392), (M, 11392)], 128, 16))
    c.add("p", [{"range": [0, 30000]}])
    c.prefill("p", 5)
    return c


def c22() -> Case:
    c = Case("core_c22_split_t3_long_prefill_threshold",
             "T3: bs 512 with long_prefill_token_threshold 384, P=1300: [384,128,384,128], then "
             "the partial-tail stop at ck(1300)=1280 gives 256 (upstream T3, partial hits off: "
             "276).",
             config([(FA, 512), (M, 512)], 32, 16, long_prefill_token_threshold=384))
    c.add("p", [{"range": [0, 1300]}])
    c.prefill("p", 5)
    return c


def c23() -> Case:
    c = Case("core_c23_pool_pressure",
             "I18 admission: an allocation that needs more blocks than are free returns None and "
             "changes nothing; after another request frees, the same allocation succeeds.",
             config([(FA, 4), (M, 8)], 4, 10))
    c.add("a", [{"range": [0, 24]}])
    c.prefill("a", 2)
    c.add("b", [{"range": [100, 124]}])
    c.op("lookup", rid="b")
    c.op("allocate", rid="b", n=24, use_hit=True)
    c.op("free", rid="a")
    c.op("lookup", rid="b")
    c.op("allocate", rid="b", n=24, use_hit=True)
    c.op("pool_state")
    return c


def c24() -> Case:
    c = Case("core_c24_truncate_hit",
             "T14: truncating a 6-token hit to 4 keeps FA [2 blocks] and Mamba [null] positions; "
             "truncating to an endpoint that is not a multiple of every block size asserts.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("append_output", rid="r0", tokens=[5])
    c.step(run=("r0",), n={"r0": 1})
    c.add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.op("lookup", rid="c")
    c.op("truncate", rid="c", n=4)
    c.op("truncate", rid="c", n=6)
    c.op("truncate", rid="c", n=0)
    return c


def c25() -> Case:
    c = Case("core_c25_delay_cache_cow_targets_uncached",
             "T11: with delay_cache the consumer's CoW targets start uncached (no key until the "
             "load completes), while the source keeps its key.",
             config([(FA, 4), (M, 4)], 2, 24))
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.op("new_step")
    c.op("lookup", rid="c")
    c.op("allocate", rid="c", n=2, use_hit=True, delay_cache=True)
    c.op("drain_copies")
    c.op("pool_state")
    c.op("release_retained")
    c.op("pool_state")
    return c


def c26() -> Case:
    c = Case("core_c26_partial_hits_off",
             "E15-like: h equal to the block size turns partial hits off: hits are whole blocks "
             "only and the split never stops at a sub-block tail.",
             config([(FA, 8), (M, 8)], 8, 24))
    c.add("p", [{"range": [0, 21]}])
    c.prefill("p", 2)
    c.add("c", [{"prompt_of": "p", "n": 20}, 99, 98])
    c.op("lookup", rid="c")
    c.add("s", [{"prompt_of": "p", "n": 7}])
    c.op("lookup", rid="s")
    c.op("pool_state")
    return c


def c27() -> Case:
    c = Case("core_c27_full_attention_only",
             "A single FA group: whole-block prefix hits, reversed free order (tail evicted "
             "first), LRU reuse of hashed blocks after unhashed ones.",
             config([(FA, 4)], 4, 12))
    c.add("a", [{"range": [0, 14]}])
    c.step(admit=("a",), n={"a": 14})
    c.op("free", rid="a")
    c.op("pool_state")
    c.add("b", [{"range": [0, 9]}, 77, 78])
    c.step(admit=("b",), n={"b": "plan"})
    c.op("pool_state")
    c.op("free", rid="b")
    c.op("pool_state")
    return c


def c28() -> Case:
    c = Case("core_c28_evict_by_key",
             "Explicit eviction strips a key even from a held block; a later lookup misses it "
             "while the block stays allocated.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("evict", keys=[[1, 6]])
    c.op("pool_state")
    c.add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.op("lookup", rid="c")
    return c


def c29() -> Case:
    c = Case("core_c29_request_id_reuse",
             "A request id reused after free starts a fresh request with its own table; the old "
             "request's cached prefix is hit by the new one when it shares tokens.",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.op("free", rid="r0")
    c.add("r0", [0, 0, 1, 1, 2, 2, 9, 9, 4])
    c.prefill("r0", 2)
    c.op("pool_state")
    return c


def c30() -> Case:
    c = Case("core_c30_preempt_mid_prefill_rehit",
             "E3: preemption mid-prefill frees the blocks without finalize; the resumed request "
             "hits what it cached before preemption.",
             config([(FA, 4), (M, 8)], 4, 24))
    c.add("p", [{"range": [0, 30]}])
    c.prefill("p", 2)
    c.op("preempt", rid="p")
    c.op("pool_state")
    c.prefill("p", 1)
    c.op("pool_state")
    return c


def c31() -> Case:
    c = Case("core_c31_two_consumers_share_tail",
             "Two consumers of one producer tail each get their own CoW copy of the shared state "
             "(the source is never written by a consumer).",
             C24)
    c.add("r0", P7)
    c.prefill("r0", 3)
    c.add("c1", [0, 0, 1, 1, 2, 2, 9, 9, 1])
    c.add("c2", [0, 0, 1, 1, 2, 2, 9, 9, 2])
    c.prefill("c1", 1)
    c.prefill("c2", 1)
    c.op("pool_state")
    return c


def c32() -> Case:
    c = Case("core_c32_decode_boundary_offered",
             "E11 (core side): an aligned Mamba snapshot reached during decode is offered by the "
             "core (the connector is the one that drops it).",
             config([(FA, 4), (M, 4)], 2, 24))
    c.add("p", [0, 1, 2, 3, 4])
    c.prefill("p", 2)
    c.op("append_output", rid="p", tokens=[9, 9, 9])
    c.step(run=("p",), n={"p": 1})
    c.step(run=("p",), n={"p": 1})
    c.step(run=("p",), n={"p": 1})
    c.op("pool_state")
    return c


def c33() -> Case:
    c = Case("core_c33_engine_split_unit",
             "The engine sets cache_config.block_size to the smallest group block size "
             "(engine/core.py); with FA 2 < Mamba 4 the split then stops at ck(7)=6 directly "
             "(chunks 6, 7) and the tail is registered inside the second Mamba block.",
             {**C1, "split_block_size": 2})
    c.add("r0", P7)
    c.prefill("r0", 2)
    c.op("pool_state")
    c.add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8])
    c.prefill("c", 2)
    c.op("pool_state")
    return c


def _lookup_bounds(c: Case) -> Case:
    """An 8-token request is prefilled (states at 4, the tail 6 and 8) and freed; the same
    prompt is then looked up under explicit bounds past, at and below its last token, and with
    none, and scheduled with the default lookup's hit."""
    c.add("r0", list(range(8)))
    c.prefill("r0", 3)
    c.op("free", rid="r0")
    c.add("r1", list(range(8)))
    c.op("new_step")
    for bound in (8, 20, 7, 5):
        c.op("lookup", rid="r1", max_len=bound)
    c.op("lookup", rid="r1")
    c.steps.schedule("r1", use_hit=True)
    c.steps.end(["r1"])
    return c


def c54() -> Case:
    return _lookup_bounds(Case(
        "core_c54_lookup_bound_taken_as_given",
        "vLLM 0.33's KVCacheManager.get_computed_blocks takes an explicit lookup bound as "
        "given: with a bound of 8 or more the 8-token prompt hits all of its 8 tokens (FA "
        "[1,2,4,6], Mamba state at 8); 7 hits 6 (the tail state), 5 hits 4; no bound means "
        "num_tokens - 1 (hit 6). Its vLLM 0.34 counterpart clamps (core_c54_..._v034).", C1))


def c54_v034() -> Case:
    return _lookup_bounds(Case(
        "core_c54_lookup_bound_taken_as_given_v034",
        "vLLM 0.34 clamps an explicit lookup bound to num_tokens - 1 "
        "(Request.get_max_cache_hit_length, called by KVCacheManager.get_computed_blocks): "
        "bounds of 8 and 20 now hit 6 like the default lookup, so the last token is always "
        "recomputed; 7 hits 6 and 5 hits 4 as on 0.33 (core_c54_lookup_bound_taken_as_given).",
        {**C1, "vllm": "0.34"}))


ALL = [c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12, c13, c14, c15, c16, c17, c18,
       c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31, c32, c33, c54, c54_v034]

if __name__ == "__main__":
    raise SystemExit(main(ALL, sys.argv[1:]))
