"""Allocate/free-heavy cycles on the reference and on vLLM 0.33's KVCacheManager.

Each cycle is ``benchmarks/core_workload.cycle``: lookup, every scheduler-split prefill chunk,
drain hand-offs and copies, release retentions, finalize, free (``Scheduler.schedule``'s order).
``python tests/reference/ref_bench.py`` prints cycles/s of both.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks/

from benchmarks.core_workload import add_all, run  # noqa: E402
from tailproof.conformance.format.trace import GroupConfig, TraceConfig  # noqa: E402


def bench_config(mamba_block: int = 64, num_blocks: int = 1024) -> TraceConfig:
    return TraceConfig(
        groups=(GroupConfig("full_attention", 16), GroupConfig("mamba_align", mamba_block)),
        hash_block_size=16, num_blocks=num_blocks)


def run_cycles(backend: Any, prompts: list[list[int]]) -> float:
    """Drive ``backend`` (a CoreBackend) through the shared benchmark cycle
    (``benchmarks/core_workload.py``) once per prompt; return the seconds spent outside
    request construction and hashing (vLLM's ``Request`` carries sampling state the
    reference does not model)."""
    rids = add_all(backend, prompts)
    t0 = time.perf_counter()
    run(backend, rids)
    return time.perf_counter() - t0


def workload(n: int, length: int, identical: bool) -> list[list[int]]:
    if identical:
        return [[(t * 7) % 11 for t in range(length)] for _ in range(n)]
    return [[i % 1000 + 1000, *((t * 7 + i) % 11 for t in range(length - 1))] for i in range(n)]


def compare(n: int = 2000, length: int = 200, identical: bool = False,
            mamba_block: int = 64, repeats: int = 3) -> tuple[float, float]:
    """(reference seconds, vllm seconds) on the same workload, each the best of ``repeats``
    interleaved runs (the machine may be shared)."""
    from tailproof.conformance.harness.adapters.reference_core import ReferenceCoreBackend
    from tailproof.conformance.harness.adapters.vllm_core import VllmCoreBackend

    cfg = bench_config(mamba_block)
    prompts = workload(n, length, identical)
    # Warm both (imports, caches), then time.
    run_cycles(ReferenceCoreBackend(cfg), prompts[:50])
    run_cycles(VllmCoreBackend(cfg), prompts[:50])
    ref = vll = float("inf")
    for _ in range(repeats):
        ref = min(ref, run_cycles(ReferenceCoreBackend(cfg), prompts))
        vll = min(vll, run_cycles(VllmCoreBackend(cfg), prompts))
    return ref, vll


if __name__ == "__main__":
    for identical in (False, True):
        for length, mb in ((40, 64), (200, 64), (600, 1024)):
            ref, vll = compare(2000, length, identical, mb)
            print(f"len {length} mamba {mb} identical={identical}: reference {2000 / ref:,.0f} "
                  f"cycles/s, vllm {2000 / vll:,.0f} cycles/s, ratio {vll / ref:.2f}")
