"""Print reference vs vLLM 0.33 core throughput on the same workload, as a ratio.

Usage: python benchmarks/core_throughput.py [--requests N] [--rounds R] [--length L] [--shared S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.core_workload import prepared, prompts, run  # noqa: E402
from tailproof.conformance.harness.adapters import ADAPTERS, _load  # noqa: E402


def best_of(name: str, reqs: list[list[int]], rounds: int) -> float:
    cls = _load(ADAPTERS[name].core)
    run(*prepared(cls, reqs[:10]))  # warm up imports and caches
    times = []
    for _ in range(rounds):
        backend, rids = prepared(cls, reqs)
        t0 = time.perf_counter()
        run(backend, rids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--length", type=int, default=200, help="prompt tokens")
    ap.add_argument("--shared", type=int, default=120, help="tokens every prompt shares")
    a = ap.parse_args()
    reqs = prompts(a.requests, a.length, a.shared)
    ref = best_of("reference", reqs, a.rounds)
    vll = best_of("vllm", reqs, a.rounds)
    print("| backend | requests/s | median s |")
    print("|---|---|---|")
    print(f"| reference | {a.requests / ref:,.0f} | {ref:.3f} |")
    print(f"| vLLM 0.33 KVCacheManager | {a.requests / vll:,.0f} | {vll:.3f} |")
    print(f"\nreference / vLLM throughput ratio: {vll / ref:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
