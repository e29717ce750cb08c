"""What the connector costs in the installed vLLM's real engine (0.33 or 0.34; CPU test bed,
tiny hybrid model).

Two figures, each a ratio of paired rounds measured in one run, rounds interleaved:

1. **Generated tokens per second**, the same workload on an engine with ``TailproofConnector``
   (memory store, saves on; every round's prompts are new, so no hit is possible) and on one
   without a connector. Each round: ``--prompts`` distinct prompts of ``--prompt-len`` tokens,
   ``--max-tokens`` greedy tokens each, timed inside the engine's process.
2. **Time to first token of a store hit vs cold** (and vs a device hit), on the connector
   engine: a new ``--long-len``-token prompt is run once with ``max_tokens=1`` (cold: the
   whole prefill), once more (a hit in vLLM's device prefix cache), then, untimed, every
   store job is drained (``drain_store_jobs``: the save's pins hold the prompt's blocks until
   the workers report it) and the device prefix cache is reset (``LLM.reset_prefix_cache``,
   which must return True; the store keeps its values), and the prompt is run a third time.
   Each hit is checked against vLLM's counters (``vllm:prefix_cache_hits`` for the device,
   ``vllm:external_prefix_cache_hits`` for the store), else the run stops. (Before this check
   the reset was refused while the save's pins held the blocks, and the "store hit" of
   BENCHMARKS.md section 14 was a device prefix-cache hit.)

A tiny model makes the connector's share look large: its forward is a few milliseconds, so the
ratio in (1) is an upper bound on what the connector costs an engine whose forward is real work.
Prints min and median of the paired ratios, the vLLM release and the machine's load average
before and after (``run_info``: one ``--json`` line on stdout, also written to ``--json FILE``).

    .venv/bin/python benchmarks/realengine_cost.py [--rounds 5] [--json FILE]
    PYTHONPATH=$(scripts/vllm_env.sh 0.33) .venv/bin/python benchmarks/realengine_cost.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from run_info import RunInfo  # noqa: E402

from tailproof.conformance.realengine.bed import (  # noqa: E402
    Bed,
    EngineSpec,
    drain_store_jobs,
    engine_metrics,
    memory_connector,
)

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


def _grew(bed: Bed, before: dict[str, float]) -> dict[str, float]:
    after = bed.call(engine_metrics)
    return {k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")}


def store_hit_ttft(bed: Bed, prompt: list[int]) -> tuple[float, float, float, int]:
    """(cold s, device-hit s, store-hit s, tokens loaded from the store) of ``prompt`` on
    ``bed``: cold, again (vLLM's device prefix cache), then the device cache emptied and again;
    stops the run unless each hit came from where it should."""
    cold, _ = bed.call(timed_generate, [prompt], 1)
    before = bed.call(engine_metrics)
    device, _ = bed.call(timed_generate, [prompt], 1)
    grew = _grew(bed, before)
    if not grew["vllm:prefix_cache_hits"] or grew["vllm:external_prefix_cache_hits"]:
        raise SystemExit(f"realengine_cost: the device hit was not a device hit: {grew}")
    if not bed.call(drain_store_jobs, 120.0):
        raise SystemExit("realengine_cost: store jobs still pinned after 120 s")
    if not bed.reset_prefix_cache():
        raise SystemExit("realengine_cost: reset_prefix_cache refused: the hit would come "
                         "from the device cache")
    before = bed.call(engine_metrics)
    hit, _ = bed.call(timed_generate, [prompt], 1)
    grew = _grew(bed, before)
    if grew["vllm:prefix_cache_hits"] or not grew["vllm:external_prefix_cache_hits"]:
        raise SystemExit(f"realengine_cost: the hit did not come from the store alone: {grew}")
    return cold, device, hit, int(grew["vllm:external_prefix_cache_hits"])


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
    info = RunInfo.start()
    spec = EngineSpec(max_model_len=4096, kv_cache_memory_bytes=128 << 20)
    conn = EngineSpec(max_model_len=4096, kv_cache_memory_bytes=128 << 20,
                      kv_transfer_config=memory_connector("bench-realengine",
                                                          capacity_bytes="1GB"))
    tps_ratio, ttft_ratio, device_ratio, rows = [], [], [], []
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
            cold, device, hit, loaded = store_hit_ttft(with_conn,
                                                       _prompts(rng, 1, args.long_len)[0])
            ttft_ratio.append(hit / cold)
            device_ratio.append(hit / device)
            rows.append({"round": r, "tokens_per_s_plain": round(tps[id(plain)], 1),
                         "tokens_per_s_connector": round(tps[id(with_conn)], 1),
                         "ratio": round(ratio, 3), "ttft_cold_s": round(cold, 4),
                         "ttft_device_hit_s": round(device, 4), "ttft_store_hit_s": round(hit, 4),
                         "ttft_ratio": round(hit / cold, 3),
                         "store_hit_tokens": loaded})
            print(f"round {r}: tok/s plain {tps[id(plain)]:.1f} connector "
                  f"{tps[id(with_conn)]:.1f} ratio {ratio:.3f}; TTFT {args.long_len} tokens "
                  f"cold {cold * 1e3:.1f} ms device hit {device * 1e3:.1f} ms store hit "
                  f"{hit * 1e3:.1f} ms ({hit / cold:.3f}, "
                  f"{loaded} tokens from the store)",
                  file=sys.stderr, flush=True)
    tps_summary, ttft_summary = _summary(tps_ratio), _summary(ttft_ratio)
    device_summary = _summary(device_ratio)
    print(f"tokens/s, connector / no connector: {tps_summary}", file=sys.stderr)
    print(f"TTFT store hit / cold ({args.long_len} tokens): {ttft_summary}", file=sys.stderr)
    print(f"TTFT store hit / device hit: {device_summary}", file=sys.stderr)
    info.finish({"benchmark": "realengine_cost", "rounds": rows,
                 "tokens_per_s_connector_over_plain": tps_summary,
                 "ttft_store_hit_over_cold": ttft_summary,
                 "ttft_store_hit_over_device_hit": device_summary, "workload": vars(args)},
                args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
