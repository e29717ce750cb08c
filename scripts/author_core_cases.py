"""Author the core (KVCacheManager-level) cases of the corpus as trace files.

Writes ``conformance/cases/core_*.json`` without expectations; record them from vLLM 0.33 with
``tailproof record conformance/cases/core_*.json --adapter vllm`` and review the values
against ../shared/notes/vllm_semantics.md §6 before committing. Steps follow the scheduler's
order: new step, lookup, plan (Mamba-aligned split), allocate, drain hand-offs, drain copies
and free their retention at once (``defer_block_free`` off), commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "conformance" / "cases"
FA, M = "full_attention", "mamba_align"


def cfg(groups: list[tuple[str, int] | tuple[str, int, bool]], h: int, blocks: int,
        **kw: Any) -> dict[str, Any]:
    gs = []
    for g in groups:
        d: dict[str, Any] = {"kind": g[0], "block_size": g[1]}
        if len(g) > 2 and g[2]:
            d["eagle"] = True
        gs.append(d)
    return {"groups": gs, "hash_block_size": h, "num_blocks": blocks, **kw}


def add(rid: str, tokens: list[Any], **kw: Any) -> list[dict[str, Any]]:
    return [{"op": "add_request", "rid": rid, "tokens": tokens, **kw}]


def step(rid: str, *, first: bool = False, n: int | str = "plan", external: int = 0,
         budget: int | None = None, release: bool = True, commit: bool = True,
         new_step: bool = True, delay_cache: bool = False) -> list[dict[str, Any]]:
    """One scheduler step for one request (a first step looks up the prefix cache)."""
    ops: list[dict[str, Any]] = [{"op": "new_step"}] if new_step else []
    if first:
        ops.append({"op": "lookup", "rid": rid})
    if n == "plan":
        plan: dict[str, Any] = {"op": "plan_chunk", "rid": rid}
        if first:
            plan["use_hit"] = True
        if external:
            plan["external"] = external
        if budget is not None:
            plan["budget"] = budget
        ops.append(plan)
    alloc: dict[str, Any] = {"op": "allocate", "rid": rid, "n": n}
    if first:
        alloc["use_hit"] = True
    if external:
        alloc["external"] = external
    if delay_cache:
        alloc["delay_cache"] = True
    ops.append(alloc)
    ops += [{"op": "drain_offloads"}, {"op": "drain_copies"}]
    if release:
        ops.append({"op": "release_retained"})
    if commit:
        ops.append({"op": "commit", "rid": rid})
    return ops


def prefill(rid: str, chunks: int, **kw: Any) -> list[dict[str, Any]]:
    """``chunks`` planned steps, the first one with a lookup."""
    ops = step(rid, first=True, **kw)
    for _ in range(chunks - 1):
        ops += step(rid, **kw)
    return ops


def snap() -> list[dict[str, Any]]:
    return [{"op": "snapshot"}]


def op(name: str, **kw: Any) -> list[dict[str, Any]]:
    return [{"op": name, **kw}]


P7 = [0, 0, 1, 1, 2, 2, 9]
C1 = cfg([(FA, 2), (M, 4)], 2, 20)
C24 = cfg([(FA, 2), (M, 4)], 2, 24)

CASES: dict[str, tuple[str, dict[str, Any], list[dict[str, Any]]]] = {
    "core_c01_producer_subblock_tail": (
        "C1/E1: a 7-token producer is split 4,6,7 by the scheduler; the chunk ending at "
        "ck(7)=6 registers a sub-block Mamba tail, the next chunk's running CoW moves its key "
        "to a fresh block and hands off that CoW target (never the overwritten source); a "
        "decode token later offers the aligned snapshot at 8; free returns blocks reversed.",
        C1, add("r0", P7) + prefill("r0", 3) + snap() + op("finalize_tail", rid="r0")
        + op("append_output", rid="r0", tokens=[5]) + step("r0", n=1) + op("free", rid="r0")
        + snap()),
    "core_c02_consumer_hits_cow_target": (
        "C2: a consumer sharing 6 tokens of the C1 producer hits 6 (FA [1,2,4], Mamba "
        "[null, cow target]); its first allocation privatises the shared tail with a "
        "first-allocation CoW and hands off its own aligned snapshot at 8.",
        C1, add("r0", P7) + prefill("r0", 3) + op("append_output", rid="r0", tokens=[5])
        + step("r0", n=1) + op("free", rid="r0")
        + add("r1", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + prefill("r1", 2) + snap()
        + op("free", rid="r1") + snap()),
    "core_c03_same_step_deferral": (
        "C3/E8: a key moved by a running CoW in this step is not consumable in the same step "
        "(allocate returns None, the copy has not run yet); the next step the hit succeeds.",
        C24, add("r0", P7) + prefill("r0", 2) + op("new_step") + op("plan_chunk", rid="r0")
        + op("allocate", rid="r0", n="plan") + op("commit", rid="r0")
        + add("r1", [0, 0, 1, 1, 2, 2, 3, 3]) + op("lookup", rid="r1")
        + op("allocate", rid="r1", n=2, use_hit=True)
        + op("drain_offloads") + op("drain_copies") + op("release_retained")
        + prefill("r1", 1) + snap()),
    "core_c04_finish_at_boundary": (
        "C4/E1: a producer aborted with num_computed == ck(P) and nothing in flight hands off "
        "its unchanged table source through finalize; a second finalize returns nothing.",
        C24, add("r0", P7) + prefill("r0", 2) + op("finalize_tail", rid="r0")
        + op("finalize_tail", rid="r0") + op("free", rid="r0") + snap()),
    "core_c05_finish_past_boundary": (
        "C4/E1: once computation advanced past ck(P) the table block no longer holds the "
        "state at the boundary, so finalize consumes the marker with no hand-off.",
        C24, add("r0", P7) + prefill("r0", 2) + op("new_step") + op("plan_chunk", rid="r0")
        + op("allocate", rid="r0", n="plan") + op("commit", rid="r0")
        + op("finalize_tail", rid="r0") + op("free", rid="r0") + snap()),
    "core_c06_finish_with_tokens_in_flight": (
        "C4/E1: with tokens in flight (async scheduling) the boundary state may be "
        "overwritten, so finalize returns nothing even at the boundary.",
        C24, add("r0", P7) + prefill("r0", 2) + op("set_in_flight", rid="r0", n=2)
        + op("finalize_tail", rid="r0") + op("set_in_flight", rid="r0", n=0)
        + op("finalize_tail", rid="r0") + op("free", rid="r0")),
    "core_c07_equal_block_sizes": (
        "C5: FA and Mamba both 4 tokens, h=2: the producer hands off (1,*,4) then the CoW "
        "tail at 6; a 9-token consumer hits 6 and CoWs both groups' partial blocks.",
        cfg([(FA, 4), (M, 4)], 2, 24), add("r0", P7) + prefill("r0", 3)
        + add("r1", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + prefill("r1", 2) + snap()),
    "core_c08_subblock_prompt_fa4_m16": (
        "C6/E4: h=4, FA 4, Mamba 16: a 13-token prompt (less than one Mamba block) publishes "
        "a tail at 12; a 16-token consumer hits 12, a resend of 13 hits 12, a 12-token "
        "prompt hits 0 (the last token is always recomputed), a 3-token prompt has no hash.",
        cfg([(FA, 4), (M, 16)], 4, 40),
        add("p", [{"range": [0, 13]}]) + prefill("p", 2)
        + add("c", [{"prompt_of": "p", "n": 12}, 50, 51, 52, 53]) + prefill("c", 1)
        + add("resend", [{"prompt_of": "p", "n": 13}]) + op("lookup", rid="resend")
        + add("twelve", [{"prompt_of": "p", "n": 12}]) + op("lookup", rid="twelve")
        + add("three", [0, 1, 2]) + op("lookup", rid="three") + snap()),
    "core_c09_eagle_h4_fa16_m16": (
        "C7/E6: with EAGLE, ck(49)=44 (one hash unit below floor(P/h)*h); the split stops at "
        "32, 44, 48, 49; a 57-token consumer and a resend both hit 44, never the proof key.",
        cfg([(FA, 16, True), (M, 16)], 4, 40, use_eagle=True),
        add("p", [{"range": [0, 49]}]) + prefill("p", 4)
        + add("c", [{"prompt_of": "p", "n": 49}, {"fill": 7, "n": 8}]) + op("lookup", rid="c")
        + add("r", [{"prompt_of": "p", "n": 49}]) + op("lookup", rid="r") + snap()),
    "core_c10_block_aligned_prompt_one_chunk": (
        "C8/E5/T15: a 4-token prompt (exactly one block) prefilled in one chunk hands off "
        "only the aligned snapshot at 4; a resend can hit at most 3 floored to 2, which needs "
        "the tail at 2 that a one-chunk prefill never registers, so it hits 0.",
        cfg([(FA, 4), (M, 4)], 2, 24), add("p", [0, 0, 1, 1]) + step("p", first=True, n=4)
        + op("append_output", rid="p", tokens=[3]) + step("p", n=1)
        + add("r", [0, 0, 1, 1]) + op("lookup", rid="r") + snap()),
    "core_c11_block_aligned_prompt_split": (
        "E5: an 8-token prompt with 4-token blocks is split 4,6,8 (ck(8)=6), so it hands off "
        "the aligned snapshot at 4, the sub-block CoW tail at 6 and the aligned one at 8; a "
        "resend of the same 8 tokens then hits 6.",
        cfg([(FA, 4), (M, 4)], 2, 24), add("p", [{"range": [0, 8]}]) + prefill("p", 3)
        + add("r", [{"prompt_of": "p", "n": 8}]) + op("lookup", rid="r") + snap()),
    "core_c12_evict_unpinned_cow_target": (
        "C9/E18: without a connector pin the running-CoW target is a cache-only block at ref 0 "
        "at the LRU tail; a 20-token filler in a 12-block pool reuses it and the sub-block hit "
        "is lost (hit 0).",
        cfg([(FA, 2), (M, 4)], 2, 12), add("r0", P7) + prefill("r0", 3) + op("free", rid="r0")
        + add("f", [{"range": [100, 120]}]) + op("lookup", rid="f")
        + op("allocate", rid="f", n=20, use_hit=True) + op("free", rid="f")
        + add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + op("lookup", rid="c") + snap()),
    "core_c13_reset_needs_all_free": (
        "C10/I19: reset_prefix_cache fails while any block is held (a live request), and "
        "succeeds once everything is free, dropping every key so the next lookup misses.",
        C24, add("r0", P7) + prefill("r0", 3) + op("reset") + op("free", rid="r0")
        + op("reset") + add("r1", P7) + op("lookup", rid="r1") + snap()),
    "core_c14_reset_blocked_by_retention": (
        "I8/I19: an undrained or unreleased CoW retention holds both endpoints, so reset "
        "fails until the retention is released.",
        C24, add("r0", P7) + prefill("r0", 2) + op("new_step") + op("plan_chunk", rid="r0")
        + op("allocate", rid="r0", n="plan") + op("commit", rid="r0") + op("free", rid="r0")
        + op("drain_copies") + op("reset") + op("release_retained") + op("reset") + snap()),
    "core_c15_preempt_and_resume": (
        "E3/T19: bs=h=8: a prompt of 8 hands off its snapshot at 8; decode 8 tokens; after "
        "preemption the resumed request re-prefills prompt+outputs and the core offers the "
        "boundary at 16, past the prompt.",
        cfg([(FA, 8), (M, 8)], 8, 16), add("p", [{"range": [0, 8]}]) + prefill("p", 1)
        + op("append_output", rid="p", tokens=[{"range": [20, 28]}])
        + sum((step("p", n=1) for _ in range(7)), [])
        + op("preempt", rid="p") + snap() + prefill("p", 1) + snap()),
    "core_c16_freed_before_drain": (
        "E2: a request freed before the step's hand-offs are drained loses them (no offload "
        "for a freed request), but its pending CoW copy still runs and holds both endpoints "
        "until the retention is released.",
        C24, add("r0", P7) + prefill("r0", 2) + op("new_step") + op("plan_chunk", rid="r0")
        + op("allocate", rid="r0", n="plan") + op("free", rid="r0") + op("drain_offloads")
        + snap() + op("drain_copies") + op("release_retained") + snap()),
    "core_c17_external_hit_same_block_running_cow": (
        "E12/T20 (#51766): a request whose table was filled by an external load and whose "
        "continuation needs no new Mamba block is still marked allocated, so its tail CoW is "
        "a running CoW (source kept, key moved to the copy).",
        cfg([(FA, 8), (M, 8)], 2, 24), add("p", [{"range": [0, 15]}])
        + step("p", first=True, external=10) + step("p") + snap()
        + op("finalize_tail", rid="p")),
    "core_c18_three_mamba_groups": (
        "E16/T18: one hand-off per Mamba group with the same boundary (groups 1, 2, 3).",
        cfg([(FA, 8), (M, 8), (M, 8), (M, 8)], 8, 32), add("p", [{"range": [0, 16]}])
        + step("p", first=True, n=8) + step("p", n=8) + snap()),
    "core_c19_smaller_fa_group": (
        "E7: FA 4 + Mamba 16, h 4: the consumer hits 12 with three FA blocks and the Mamba "
        "CoW target; blocks of the smaller group inside the Mamba block are all adopted.",
        cfg([(FA, 4), (M, 16)], 4, 40), add("p", [{"range": [0, 13]}]) + prefill("p", 2)
        + add("c", [{"prompt_of": "p", "n": 12}, 60, 61, 62, 63, 64]) + prefill("c", 2) + snap()),
    "core_c20_split_t1_budget": (
        "T1: bs 512, h 32, budget 8192, P=10000: chunks 8192, 1536, 256 (tail stop at "
        "ck=9984), 16.",
        cfg([(FA, 512), (M, 512)], 32, 64), add("p", [{"range": [0, 10000]}])
        + prefill("p", 4) + op("finalize_tail", rid="p")),
    "core_c21_split_t2_block_exceeds_budget": (
        "T2: a 11392-token Mamba block larger than the 8192-token budget advances sub-block "
        "and re-aligns at the next boundary: [8192, 3200, 8192, 3200], then the tail stop at "
        "ck(30000)=29952 cuts the last chunk to 7168 (upstream T2 has partial hits off: 7216).",
        cfg([(FA, 11392), (M, 11392)], 128, 16), add("p", [{"range": [0, 30000]}])
        + prefill("p", 5)),
    "core_c22_split_t3_long_prefill_threshold": (
        "T3: bs 512 with long_prefill_token_threshold 384, P=1300: [384,128,384,128], then "
        "the partial-tail stop at ck(1300)=1280 gives 256 (upstream T3, partial hits off: 276).",
        cfg([(FA, 512), (M, 512)], 32, 16, long_prefill_token_threshold=384),
        add("p", [{"range": [0, 1300]}]) + prefill("p", 5)),
    "core_c23_pool_pressure": (
        "I18 admission: an allocation that needs more blocks than are free returns None and "
        "changes nothing; after another request frees, the same allocation succeeds.",
        cfg([(FA, 4), (M, 8)], 4, 10), add("a", [{"range": [0, 24]}]) + prefill("a", 2)
        + add("b", [{"range": [100, 124]}]) + op("lookup", rid="b")
        + op("allocate", rid="b", n=24, use_hit=True) + op("free", rid="a")
        + op("lookup", rid="b") + op("allocate", rid="b", n=24, use_hit=True) + snap()),
    "core_c24_truncate_hit": (
        "T14: truncating a 6-token hit to 4 keeps FA [2 blocks] and Mamba [null] positions; "
        "truncating to an endpoint that is not a multiple of every block size asserts.",
        C24, add("r0", P7) + prefill("r0", 3) + op("append_output", rid="r0", tokens=[5])
        + step("r0", n=1) + add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + op("lookup", rid="c")
        + op("truncate", rid="c", n=4) + op("truncate", rid="c", n=6) + op("truncate", rid="c",
                                                                            n=0)),
    "core_c25_delay_cache_cow_targets_uncached": (
        "T11: with delay_cache the consumer's CoW targets start uncached (no key until the "
        "load completes), while the source keeps its key.",
        cfg([(FA, 4), (M, 4)], 2, 24), add("r0", P7) + prefill("r0", 3)
        + add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + op("new_step") + op("lookup", rid="c")
        + op("allocate", rid="c", n=2, use_hit=True, delay_cache=True) + op("drain_copies")
        + snap() + op("release_retained") + snap()),
    "core_c26_partial_hits_off": (
        "E15-like: h equal to the block size turns partial hits off: hits are whole blocks "
        "only and the split never stops at a sub-block tail.",
        cfg([(FA, 8), (M, 8)], 8, 24), add("p", [{"range": [0, 21]}]) + prefill("p", 2)
        + add("c", [{"prompt_of": "p", "n": 20}, 99, 98]) + op("lookup", rid="c")
        + add("s", [{"prompt_of": "p", "n": 7}]) + op("lookup", rid="s") + snap()),
    "core_c27_full_attention_only": (
        "A single FA group: whole-block prefix hits, reversed free order (tail evicted "
        "first), LRU reuse of hashed blocks after unhashed ones.",
        cfg([(FA, 4)], 4, 12), add("a", [{"range": [0, 14]}]) + step("a", first=True, n=14)
        + op("free", rid="a") + snap() + add("b", [{"range": [0, 9]}, 77, 78])
        + step("b", first=True, n="plan") + snap() + op("free", rid="b") + snap()),
    "core_c28_evict_by_key": (
        "Explicit eviction strips a key even from a held block; a later lookup misses it "
        "while the block stays allocated.",
        C24, add("r0", P7) + prefill("r0", 3) + op("evict", keys=[[1, 6]]) + snap()
        + add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + op("lookup", rid="c")),
    "core_c29_request_id_reuse": (
        "A request id reused after free starts a fresh request with its own table; the old "
        "request's cached prefix is hit by the new one when it shares tokens.",
        C24, add("r0", P7) + prefill("r0", 3) + op("free", rid="r0")
        + add("r0", [0, 0, 1, 1, 2, 2, 9, 9, 4]) + prefill("r0", 2) + snap()),
    "core_c30_preempt_mid_prefill_rehit": (
        "E3: preemption mid-prefill frees the blocks without finalize; the resumed request "
        "hits what it cached before preemption.",
        cfg([(FA, 4), (M, 8)], 4, 24), add("p", [{"range": [0, 30]}]) + prefill("p", 2)
        + op("preempt", rid="p") + snap() + prefill("p", 1) + snap()),
    "core_c31_two_consumers_share_tail": (
        "Two consumers of one producer tail each get their own CoW copy of the shared state "
        "(the source is never written by a consumer).",
        C24, add("r0", P7) + prefill("r0", 3) + add("c1", [0, 0, 1, 1, 2, 2, 9, 9, 1])
        + add("c2", [0, 0, 1, 1, 2, 2, 9, 9, 2]) + prefill("c1", 1) + prefill("c2", 1) + snap()),
    "core_c32_decode_boundary_offered": (
        "E11 (core side): an aligned Mamba snapshot reached during decode is offered by the "
        "core (the connector is the one that drops it).",
        cfg([(FA, 4), (M, 4)], 2, 24), add("p", [0, 1, 2, 3, 4]) + prefill("p", 2)
        + op("append_output", rid="p", tokens=[9, 9, 9]) + step("p", n=1) + step("p", n=1)
        + step("p", n=1) + snap()),
    "core_c33_engine_split_unit": (
        "The engine sets cache_config.block_size to the smallest group block size "
        "(engine/core.py); with FA 2 < Mamba 4 the split then stops at ck(7)=6 directly "
        "(chunks 6, 7) and the tail is registered inside the second Mamba block.",
        {**C1, "split_block_size": 2}, add("r0", P7) + prefill("r0", 2) + snap()
        + add("c", [0, 0, 1, 1, 2, 2, 9, 9, 8]) + prefill("c", 2) + snap()),
}


def _keep_reviewed_expectations(doc: dict[str, Any], path: Path) -> None:
    """Carry recorded expectations over when a case's config and ops are unchanged."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    bare = [{k: v for k, v in o.items() if k != "expect"} for o in old["ops"]]
    if old.get("config") == doc["config"] and bare == doc["ops"]:
        doc["ops"] = old["ops"]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (desc, config, ops) in CASES.items():
        doc = {"format": "tailproof-trace/1", "name": name, "description": desc,
               "config": config, "ops": ops}
        path = OUT / f"{name}.json"
        _keep_reviewed_expectations(doc, path)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(CASES)} cases to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
