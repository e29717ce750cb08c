"""The shared-prefix junction cases of the corpus, ``conformance/cases/core_j*.json``: vLLM
0.33's Marconi-style junction (``Request.shared_prefix_boundary``), recorded from vLLM while
authored, with the reference run in lockstep (strict block ids).

The admission lookup sets the junction when full attention hits past Mamba
(``KVCacheManager.get_computed_blocks``); ``Scheduler._mamba_block_aligned_split`` stops a
chunk that crosses it, block-floored from the chunk start unless
``enable_mamba_shared_prefix_checkpoint`` takes effect (an EAGLE group and partial hits), when it
stops at the junction itself and ``MambaManager._cache_partial_tail_block`` keys the state
there. Geometry: full attention 2, Mamba 4, h = 2; a shared prefix of 6 tokens ends off the
Mamba grid.

    .venv/bin/python scripts/author_junction_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys
from typing import Any

from tailproof.conformance.tools.authoring.author import FA, Case, M, config, main

RECORD = ("vllm", "reference")
FLAG = {"enable_mamba_shared_prefix_checkpoint": True}
OFF = config([(FA, 2), (M, 4)], 2, 48)
# The flag set, but no EAGLE group: KVCacheManager narrows it away.
FLAG_NO_EAGLE = config([(FA, 2), (M, 4)], 2, 48, **FLAG)
# EAGLE flagged on the Mamba group without the block drop (use_eagle off, as with hash
# lookahead): the flag takes effect and lookups are not shortened by the drop.
ON = config([(FA, 2), (M, 4, True)], 2, 48, **FLAG)
# EAGLE with the block drop (use_eagle on): ck(P) and FA hits back off one block.
ON_DROP = config([(FA, 2), (M, 4, True)], 2, 48, use_eagle=True, **FLAG)

SHARED = [1, 1, 2, 2, 3, 3]  # 6 tokens: the junction, off the Mamba grid of 4


def conv(k: int) -> list[Any]:
    """Conversation k: the shared prefix, then 5 tokens of its own."""
    return [*SHARED, 10 * k + 4, 10 * k + 4, 10 * k + 5, 10 * k + 5, 10 * k + 6]


def prefill(c: Case, rid: str, budget: int | None = None, upto: int | None = None) -> None:
    """Admit ``rid`` and run its planned chunks until ``upto`` tokens (default: its prompt)
    are computed, as the commit observations report."""
    if upto is None:
        upto = next(len(o["tokens"]) for o in c.ops
                    if o["op"] == "add_request" and o["rid"] == rid)
    first = len(c.ops)
    c.step(admit=(rid,), budget=budget)
    while True:
        commits = [e for o, e in zip(c.ops[first:], c.expects[first:], strict=True)
                   if o["op"] == "commit" and o["rid"] == rid]
        if commits and commits[-1] is not None and commits[-1]["computed"] >= upto:
            return
        c.step(run=(rid,))


def finish(c: Case, rid: str) -> None:
    c.op("finalize_tail", rid=rid)
    c.op("free", rid=rid)


def three_conversations(name: str, description: str, cfg: dict[str, Any]) -> Case:
    """A computes its prompt (Mamba states at 8 and the tail 10, none at or below 6); B shares
    6 tokens with it (junction 6, local hit 0); C shares the same 6 tokens after B."""
    c = Case(name, description, cfg, RECORD)
    c.add("a", conv(0))
    prefill(c, "a")
    finish(c, "a")
    c.add("b", conv(1))
    prefill(c, "b")
    c.op("pool_state")
    finish(c, "b")
    c.add("c", conv(2))
    prefill(c, "c")
    c.op("pool_state")
    return c


def j01() -> Case:
    return three_conversations(
        "core_j01_junction_off_grid_flag_off",
        "Flag off: B's lookup hits 0 (Mamba has no state at or below 6) with junction 6; the "
        "split stops B's first chunk at the junction floored to the Mamba block (4), so C "
        "resumes at B's state at 4 (hit 4, junction 6 again, no further stop).",
        OFF)


def j02() -> Case:
    return three_conversations(
        "core_j02_junction_flag_without_eagle",
        "enable_mamba_shared_prefix_checkpoint set without an EAGLE group: "
        "KVCacheManager.mamba_shared_prefix_checkpoint narrows it away, so everything is as "
        "with the flag off (block-floored stop at 4, C hits 4).",
        FLAG_NO_EAGLE)


def j03() -> Case:
    return three_conversations(
        "core_j03_junction_flag_on",
        "Flag on with EAGLE flagged on the Mamba group (no block drop): B's first chunk stops "
        "at the junction 6 itself and MambaManager._cache_partial_tail_block keys the "
        "sub-block state there (a producer: CoW at the next chunk, tail hand-off); C resumes "
        "at the junction state (hit 6, junction 0).",
        ON)


def j04() -> Case:
    c = three_conversations(
        "core_j04_junction_flag_on_eagle_drop",
        "Flag on with use_eagle (the EAGLE block drop): A's tail and every FA hit back off one "
        "block, so the junction B sees and the stop it gets follow the drop; recorded from "
        "vLLM.",
        ON_DROP)
    return c


LONG = [*SHARED, 4, 4, 5, 5, 6, 6, 7, 7]  # 14 tokens: a junction 3.5 blocks out


def later_chunk(name: str, description: str, cfg: dict[str, Any]) -> Case:
    """A computes a 19-token prompt (Mamba states at 16 and the tail 18); B shares 14 tokens
    (hit 0, junction 14) and its admission chunk is cut to one block by the token budget, so
    the junction falls in B's second chunk, which starts at 4; C then shares the same 14."""
    c = Case(name, description, cfg, RECORD)
    c.add("a", [*LONG, 8, 8, 9, 9, 5])
    prefill(c, "a")
    finish(c, "a")
    c.add("b", [*LONG, 18, 18, 19, 19, 15])
    prefill(c, "b", budget=4)
    finish(c, "b")
    c.add("c", [*LONG, 28, 28, 29, 29, 25])
    prefill(c, "c")
    c.op("pool_state")
    return c


def j05() -> Case:
    return later_chunk(
        "core_j05_junction_in_later_chunk",
        "The junction in a later chunk, flag on: B's second chunk (from 4) stops at the "
        "junction 14 itself and keys the state there (num_computed 4 < 14 <= prompt); C "
        "resumes at 14.",
        ON)


def j06() -> Case:
    return later_chunk(
        "core_j06_junction_later_chunk_flag_off",
        "The junction in a later chunk, flag off: B's second chunk (from 4) stops at the "
        "junction floored from the chunk start, 4 + 4*((14 - 4) // 4) = 12; C resumes at 12 "
        "with junction 14 again.",
        OFF)


def j07() -> Case:
    c = Case("core_j07_junction_on_block_boundary",
             "A junction on the Mamba grid (a shared prefix of 8): flag on or off the stop is "
             "the junction itself and the state is an ordinary full-block key; C hits 8.",
             ON, RECORD)
    shared = [*SHARED, 3, 3]
    c.add("a", [*shared, 4, 4, 5, 5, 6])
    prefill(c, "a")
    finish(c, "a")
    c.add("b", [*shared, 14, 14, 15, 15, 16])
    prefill(c, "b")
    finish(c, "b")
    c.add("c", [*shared, 24, 24, 25, 25, 26])
    prefill(c, "c")
    c.op("pool_state")
    return c


def j08() -> Case:
    c = Case("core_j08_junction_capped_at_prompt",
             "B's whole prompt is a prefix of A's tokens: the lookup caps at prompt - 1 floored "
             "to h (6 of a 7-token prompt), which is where the junction lands; flag on, the "
             "stop at 6 coincides with ck(7) and one key serves both.",
             ON, RECORD)
    c.add("a", [*SHARED, 7, 7, 8, 8, 9, 9, 5])
    prefill(c, "a")
    finish(c, "a")
    c.add("b", [*SHARED, 7])
    prefill(c, "b")
    c.op("pool_state")
    finish(c, "b")
    return c


def j09() -> Case:
    c = Case("core_j09_junction_past_prompt_on_resume",
             "A junction past the prompt: B (7-token prompt) decodes to 11 tokens, is preempted "
             "and its Mamba states at 8 and 6 are evicted; re-admitted with 12 tokens, it hits "
             "4 with junction 10 > its prompt, so even with the flag on the split falls back to "
             "the block-floored stop (8) and nothing is keyed at the junction.",
             ON, RECORD)
    c.add("b", [*SHARED, 7])
    prefill(c, "b")
    for t in range(4):
        c.op("append_output", rid="b", tokens=[40 + t])
        c.step(run=("b",), n={"b": 1})
    c.op("preempt", rid="b")
    c.op("evict", keys=[[1, 8], [1, 6]])
    c.op("append_output", rid="b", tokens=[50])
    prefill(c, "b", upto=12)
    c.op("pool_state")
    return c


ALL = [j01, j02, j03, j04, j05, j06, j07, j08, j09]

if __name__ == "__main__":
    raise SystemExit(main(ALL, sys.argv[1:]))
