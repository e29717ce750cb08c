"""The Mamba speculative-block cases of the corpus, ``conformance/cases/core_s*.json``: a Mamba
group with ``MambaSpec.num_speculative_blocks`` S > 0 (vLLM 0.33's ``MambaManager`` in align
mode), recorded from vLLM while authored, with the reference run in lockstep (strict block ids).

What S changes (``single_type_kv_cache_manager.MambaManager``): ``get_num_blocks_to_allocate``
asks for ``cdiv(n, B) + S`` blocks and caps a request's first allocation at ``1 + S`` (+1 for a
CoW target); ``allocate_new_blocks`` keeps S scratch blocks after the running state, moves the
scratch blocks a multi-block chunk passes to the end of the table behind null entries
(``_relocate_speculative_block``) and records the previous running state at ``len - 1 - S``.

    .venv/bin/python scripts/author_specblock_cases.py [--check] [--out DIR] [NAME ...]
"""

from __future__ import annotations

import sys

from tailproof.conformance.tools.authoring.author import FA, Case, M, config, main

RECORD = ("vllm", "reference")
P = list(range(2000, 2100))


def _config(fa: int, mamba: int, h: int, spec_blocks: int, num_blocks: int,
            **settings: object) -> dict[str, object]:
    doc = config([(FA, fa), (M, mamba)], h, num_blocks, **settings)
    doc["groups"][1]["num_speculative_blocks"] = spec_blocks
    return doc


def s01() -> Case:
    c = Case("core_s01_spec_block_relocated_behind_nulls",
             "One Mamba speculative block (S = 1; FA8+M8, h = 4, at most 16 tokens a step). "
             "A 45-token prompt: the first 16-token chunk allocates the running state plus one "
             "scratch block (1 + S before the first allocation); the second chunk passes two "
             "blocks, so the scratch block is moved to the end of the table behind a null "
             "entry (_relocate_speculative_block) and holds the running state at 32, and a new "
             "scratch block follows; chunks of 8 and 4 tokens end at ck(45) = 44. A decode "
             "with 1 draft (rejected) stays in its block; one with 2 drafts crosses 48, where "
             "the scratch block becomes the running state in place and a new one follows. A "
             "34-token prompt sharing 24 tokens hits 16 (the Mamba states are at 16 and 32): "
             "its first allocation adds the running state and one scratch block after the "
             "null-padded hit.",
             _config(8, 8, 4, 1, 40, max_num_scheduled_tokens=16), RECORD)
    c.add("A", P[:45], max_tokens=8)
    c.prefill("A", 2)
    c.op("table", rid="A")
    c.op("pool_state")
    c.step(run=("A",))
    c.step(run=("A",))
    c.op("table", rid="A")
    c.op("append_output", rid="A", tokens=[7])
    c.op("new_step")
    c.op("plan_chunk", rid="A", drafts=1)
    c.op("allocate", rid="A", n="plan")
    c.steps.drain()
    c.op("commit", rid="A")
    c.op("rollback", rid="A", n=1)
    c.op("append_output", rid="A", tokens=[8])
    c.op("table", rid="A")
    c.op("new_step")
    c.op("plan_chunk", rid="A", drafts=2)
    c.op("allocate", rid="A", n="plan")
    c.steps.drain()
    c.op("commit", rid="A")
    c.op("rollback", rid="A", n=0)
    c.op("append_output", rid="A", tokens=[3, 4, 5])
    c.op("table", rid="A")
    c.op("pool_state")
    c.add("B", P[:24] + [9] * 10, max_tokens=4)
    c.step(run=("A",), admit=("B",))
    c.op("table", rid="B")
    c.op("pool_state")
    c.op("free", rid="A")
    c.op("free", rid="B")
    c.op("pool_state")
    return c


def s02() -> Case:
    c = Case("core_s02_two_spec_blocks_admission_and_running_cow",
             "Two Mamba speculative blocks (S = 2; FA16+M16, h = 4, partial hits on). A "
             "13-token prompt registers its Mamba tail at ck = 12 and its next step's running "
             "CoW moves the keys to a new block while the table keeps its running state and "
             "both scratch blocks. A 60-token prompt prefilled in a 16-token chunk (a 16-token "
             "budget) then a 32-token chunk passes two blocks: the first scratch block is "
             "relocated behind a null entry, the second becomes the running state in place. "
             "Decode with 2 drafts, 1 rejected. With the pool nearly full, a consumer of the "
             "12-token tail needs its CoW target plus 1 + S Mamba blocks and a full-attention "
             "block: refused one block short, admitted once the producer is freed.",
             _config(16, 16, 4, 2, 17, max_num_scheduled_tokens=32), RECORD)
    c.add("A", P[:13], max_tokens=8)
    c.step(admit=("A",))
    c.op("pool_state")
    c.step(run=("A",))
    c.op("table", rid="A")
    c.op("pool_state")
    c.add("B", P[40:100], max_tokens=8)
    c.step(admit=("B",), budget=16)
    c.step(run=("B",))
    c.op("table", rid="B")
    c.op("append_output", rid="B", tokens=[1])
    c.op("new_step")
    c.op("plan_chunk", rid="B", drafts=2)
    c.op("allocate", rid="B", n="plan")
    c.steps.drain()
    c.op("commit", rid="B")
    c.op("rollback", rid="B", n=1)
    c.op("append_output", rid="B", tokens=[2, 3])
    c.op("table", rid="B")
    c.op("pool_state")
    c.add("C", P[:12] + [5] * 6, max_tokens=4)
    c.step(admit=("C",))
    c.op("pool_state")
    c.op("free", rid="A")
    c.step(run=("B",), admit=("C",))
    c.op("table", rid="C")
    c.op("pool_state")
    c.op("free", rid="B")
    c.op("free", rid="C")
    c.op("pool_state")
    return c


ALL = [s01, s02]

if __name__ == "__main__":
    raise SystemExit(main(ALL, sys.argv[1:]))
