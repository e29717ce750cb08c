"""The sliding-window cases of the corpus, ``conformance/cases/core_w*.json``: a sliding-window
group (``SlidingWindowSpec``, vLLM 0.33's ``SlidingWindowManager``) beside full attention and
Mamba, recorded from vLLM while authored, with the reference run in lockstep (strict block ids).

Geometry: full attention 16, a window of 17 tokens in blocks of 16 (EAGLE on it), Mamba 64,
h = 8. The window's blocks are not h, so ``partial_hash_hits_enabled`` turns partial hits off
and hits are multiples of the lcm (64). A hit on the window needs ``cdiv(17 - 1, 16) = 1``
cached block ending on the hit, plus the EAGLE peek block past it; dense retention caches
only those (``SlidingWindowManager.reachable_block_mask``: blocks 3 and 4, 7 and 8, ...).

    .venv/bin/python scripts/author_window_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys

from tailproof.conformance.tools.authoring.author import FA, Case, M, config, main

RECORD = ("vllm", "reference")
SW = "sliding_window"
P = list(range(1000, 1300))


def _window_config(window: int) -> dict[str, object]:
    doc = config([(FA, 16), (SW, 16, True), (M, 64)], 8, 96, use_eagle=True,
                 max_num_scheduled_tokens=64)
    doc["groups"][1]["sliding_window"] = window
    return doc


def w01() -> Case:
    c = Case("core_w01_window_eagle_reverified_after_shrink",
             "A 200-token prompt prefilled in 64-token chunks caches full attention to 192, "
             "window blocks 3-4, 7-8 (reachable mask) with null-padded tables, Mamba states at "
             "64, 128 and 192. With the window's peek block at 80 and Mamba's state at 128 "
             "evicted, a 230-token prompt's lookup: the window (EAGLE) verifies 128, Mamba "
             "shrinks to 64, which clears the EAGLE verifications "
             "(HybridKVCacheCoordinator.find_longest_cache_hit), so the window is looked up "
             "again with the drop: its peek block 4 is gone and the joint hit is 0.",
             _window_config(17), RECORD)
    c.add("A", P[:200], max_tokens=2)
    c.prefill("A", 4)
    c.op("free", rid="A")
    c.op("pool_state")
    c.op("evict", keys=[[1, 80], [2, 128]])
    c.add("C", P[:230], max_tokens=2)
    c.step(admit=["C"])
    c.op("pool_state")
    return c


def w02() -> Case:
    c = Case("core_w02_window_hit_null_padded",
             "A 150-token prompt prefilled in 64-token chunks frees the window's blocks before "
             "each chunk's window (SlidingWindowManager.get_num_skipped_tokens, "
             "remove_skipped_blocks: null blocks in its table). While it runs, a prompt sharing "
             "140 tokens hits 64 (junction 128: full attention runs past Mamba): full "
             "attention 4 blocks, the window null-padded up to its block 3 (the run, its "
             "EAGLE peek dropped), Mamba one state.",
             _window_config(17), RECORD)
    c.add("A", P[:150], max_tokens=2)
    c.prefill("A", 3)
    c.op("pool_state")
    c.add("B", P[:140] + [7] * 30, max_tokens=2)
    c.step(admit=["B"])
    c.op("pool_state")
    c.op("free", rid="A")
    c.op("free", rid="B")
    c.op("pool_state")
    return c


ALL = [w01, w02]

if __name__ == "__main__":
    raise SystemExit(main(ALL, sys.argv[1:]))
