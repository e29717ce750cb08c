"""What the connector costs in vLLM 0.33's real engine (CPU test bed, tiny hybrid model).

Two figures, each a ratio of paired rounds measured in one run, rounds interleaved:

1. **Generated tokens per second**, the same workload on an engine with ``TailproofConnector``
   (memory store, saves on; every round's prompts are new, so no hit is possible) and on one
   without a connector. Each round: ``--prompts`` distinct prompts of ``--prompt-len`` tokens,
   ``--max-tokens`` greedy tokens each, timed inside the engine's process.
2. **Time to first token of a store hit vs cold**, on the connector engine: a new
   ``--long-len``-token prompt is run once with ``max_tokens=1`` (cold: the whole prefill),
   the device prefix cache is reset (``LLM.reset_prefix_cache``; the store keeps its values),
   and the same prompt is run again (its prefix is loaded from the store).

A tiny model makes the connector's share look large: its forward is a few milliseconds, so the
ratio in (1) is an upper bound on what the connector costs an engine whose forward is real work.
Prints min and median of the paired ratios and the machine's load average before and after.

    .venv/bin/python benchmarks/realengine_cost.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from tailproof.conformance.realengine.bed import Bed, EngineSpec, memory_connector

VOCAB = 60  # token ids 1..59 (the test-bed model's vocabulary is 64)


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, generated tokens) of one ``LLM.generate`` call, timed in the engine process."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


def _summary(ratios: list[float]) -> dict[str, float]:
    return {"min": round(min(ratios), 3), "median": round(statistics.median(ratios), 3),
            "max": round(max(ratios), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=3000)
    ap.add_argument("--json", metavar="FILE",
                    help="also write the figures as JSON to FILE (the engines log to stdout)")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    load0 = os.getloadavg()
    spec = EngineSpec(max_model_len=4096, kv_cache_memory_bytes=128 << 20)
    conn = EngineSpec(max_model_len=4096, kv_cache_memory_bytes=128 << 20,
                      kv_transfer_config=memory_connector("bench-realengine",
                                                          capacity_bytes="1GB"))
    tps_ratio, ttft_ratio, rows = [], [], []
    with Bed(spec) as plain, Bed(conn) as with_conn:
        warm = _prompts(rng, 2, 64)  # first-call costs (allocations, lazy imports) off the clock
        for bed in (plain, with_conn):
            bed.call(timed_generate, warm, 4)
        for r in range(args.rounds):
            prompts = _prompts(rng, args.prompts, args.prompt_len)
            order = (plain, with_conn) if r % 2 == 0 else (with_conn, plain)
            tps = {}
            for bed in order:
                dt, n = bed.call(timed_generate, prompts, args.max_tokens)
                tps[id(bed)] = n / dt
            ratio = tps[id(with_conn)] / tps[id(plain)]
            tps_ratio.append(ratio)
            long = _prompts(rng, 1, args.long_len)
            cold, _ = with_conn.call(timed_generate, long, 1)
            with_conn.reset_prefix_cache()
            hit, _ = with_conn.call(timed_generate, long, 1)
            ttft_ratio.append(hit / cold)
            rows.append({"round": r, "tokens_per_s_plain": round(tps[id(plain)], 1),
                         "tokens_per_s_connector": round(tps[id(with_conn)], 1),
                         "ratio": round(ratio, 3), "ttft_cold_s": round(cold, 4),
                         "ttft_store_hit_s": round(hit, 4), "ttft_ratio": round(hit / cold, 3)})
            print(f"round {r}: tok/s plain {tps[id(plain)]:.1f} connector "
                  f"{tps[id(with_conn)]:.1f} ratio {ratio:.3f}; TTFT {args.long_len} tokens "
                  f"cold {cold * 1e3:.1f} ms store hit {hit * 1e3:.1f} ms ({hit / cold:.3f})",
                  file=sys.stderr, flush=True)
    out = {"rounds": rows, "tokens_per_s_connector_over_plain": _summary(tps_ratio),
           "ttft_store_hit_over_cold": _summary(ttft_ratio),
           "load_avg_before": [round(x, 2) for x in load0],
           "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "workload": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"tokens/s, connector / no connector: {out['tokens_per_s_connector_over_plain']}",
          file=sys.stderr)
    print(f"TTFT store hit / cold ({args.long_len} tokens): {out['ttft_store_hit_over_cold']}",
          file=sys.stderr)
    print(f"load average before {out['load_avg_before']} after {out['load_avg_after']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
