"""The reference ÷ the installed vLLM's ``KVCacheManager`` on the same workload, paired rounds.

Each round runs the workload of ``core_workload`` (every request created and hashed untimed)
on a fresh backend of each, in an order that alternates per round; a round's ratio is vLLM's
time over the reference's (above 1: the reference is faster). Prints min and median of the
paired ratios per prompt shape, the vLLM release and the machine's load (``run_info``).

    .venv/bin/python benchmarks/core_throughput.py [--requests 300] [--rounds 9]
        [--shape 200:120 --shape 40:32 ...] [--json FILE]
    PYTHONPATH=$(scripts/vllm_env.sh 0.33) .venv/bin/python benchmarks/core_throughput.py

``--shape L:S``: L-token prompts sharing an S-token prefix (default: the four of BENCHMARKS.md
section 1).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.core_workload import prepared, prompts, run  # noqa: E402
from benchmarks.run_info import RunInfo  # noqa: E402
from tailproof.conformance.harness.adapters import ADAPTERS, _load  # noqa: E402

SHAPES = ("200:120", "200:0", "40:32", "1100:1050")


def once(cls: type, reqs: list[list[int]]) -> float:
    """Seconds of one run of the workload on a fresh backend (set-up untimed)."""
    backend, rids = prepared(cls, reqs)
    gc.collect()
    t0 = time.perf_counter()
    run(backend, rids)
    return time.perf_counter() - t0


def paired(reqs: list[list[int]], rounds: int) -> dict[str, float]:
    """Paired rounds on the reference and vLLM; min / median seconds and of the ratios."""
    classes = {name: _load(ADAPTERS[name].core) for name in ("reference", "vllm")}
    for cls in classes.values():
        run(*prepared(cls, reqs[:10]))  # warm up imports and caches
    times: dict[str, list[float]] = {name: [] for name in classes}
    for r in range(rounds):
        for name in (("reference", "vllm") if r % 2 == 0 else ("vllm", "reference")):
            times[name].append(once(classes[name], reqs))
    ratios = [v / f for f, v in zip(times["reference"], times["vllm"], strict=True)]
    return {"reference_s_min": min(times["reference"]),
            "reference_s_median": statistics.median(times["reference"]),
            "vllm_s_min": min(times["vllm"]), "vllm_s_median": statistics.median(times["vllm"]),
            "reference_over_vllm_speed_min": round(min(ratios), 3),
            "reference_over_vllm_speed_median": round(statistics.median(ratios), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", action="append", metavar="L:S",
                    help="prompt tokens : tokens every prompt shares (repeatable)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    a = ap.parse_args(argv)
    info = RunInfo.start()
    rows = {}
    print("| prompts (L:S) | reference req/s (median) | vLLM req/s (median) "
          "| reference ÷ vLLM speed, paired min / median |")
    print("|---|---:|---:|---:|")
    for shape in a.shape or SHAPES:
        length, shared = (int(x) for x in shape.split(":"))
        row = paired(prompts(a.requests, length, shared), a.rounds)
        rows[shape] = row
        print(f"| {shape} | {a.requests / row['reference_s_median']:,.0f} | "
              f"{a.requests / row['vllm_s_median']:,.0f} | "
              f"{row['reference_over_vllm_speed_min']:.2f} / "
              f"{row['reference_over_vllm_speed_median']:.2f} |", flush=True)
    info.finish({"benchmark": "core_throughput", "requests": a.requests, "rounds": a.rounds,
                 "shapes": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
