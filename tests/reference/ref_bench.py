"""Allocate/free-heavy cycles on the reference and on vLLM 0.33's KVCacheManager.

Each cycle: lookup, allocate every scheduler-split prefill chunk, drain and release CoW copies,
drain hand-offs, free, next step (the loop of ``vllm_cpu.md`` §4).
``python tests/reference/ref_bench.py`` prints cycles/s of both.
"""

from __future__ import annotations

import time
from typing import Any

from tailproof.conformance.trace import GroupConfig, TraceConfig


def bench_config(mamba_block: int = 64, num_blocks: int = 1024) -> TraceConfig:
    return TraceConfig(
        groups=(GroupConfig("full_attention", 16), GroupConfig("mamba_align", mamba_block)),
        hash_block_size=16, num_blocks=num_blocks)


def run_cycles(backend: Any, prompts: list[list[int]], drain_release: bool = True) -> float:
    """Drive ``backend`` (a CoreBackend) through one cycle per prompt; return the seconds spent
    outside ``add_request`` (request construction and hashing are timed separately by
    neither: vLLM's ``Request`` carries sampling state the reference does not model)."""
    for i, prompt in enumerate(prompts):
        backend.add_request(f"r{i}", prompt, 4)
    t0 = time.perf_counter()
    for i in range(len(prompts)):
        rid = f"r{i}"
        hit, _ = backend.lookup(rid, None)
        use_hit = True
        while True:
            v = backend.get(rid)
            start = v.num_computed_tokens + (hit if use_hit else 0)
            if start >= v.num_tokens:
                break
            n = backend.plan_chunk(rid, v.num_tokens - start, hit if use_hit else 0, 0)
            new = backend.allocate(rid, n, use_hit=use_hit, external=0, delay_cache=False,
                                   lookahead=0)
            assert new is not None
            backend.set_counters(rid, num_computed_tokens=backend.get(rid).num_computed_tokens
                                 + n)
            use_hit = False
            _, retained = backend.drain_copies()
            if drain_release and retained:
                backend.release(retained)
            backend.drain_offloads()
            backend.new_step()
        backend.free(rid)
        backend.new_step()
    return time.perf_counter() - t0


def workload(n: int, length: int, identical: bool) -> list[list[int]]:
    if identical:
        return [[(t * 7) % 11 for t in range(length)] for _ in range(n)]
    return [[i % 1000 + 1000, *((t * 7 + i) % 11 for t in range(length - 1))] for i in range(n)]


def compare(n: int = 2000, length: int = 200, identical: bool = False,
            mamba_block: int = 64, repeats: int = 3) -> tuple[float, float]:
    """(reference seconds, vllm seconds) on the same workload, each the best of ``repeats``
    interleaved runs (the machine may be shared)."""
    from tailproof.conformance.adapters.reference_core import ReferenceCoreBackend

    try:
        from ref_vllm_shim import vllm_backend_class
    except ImportError:  # run as a script from the repo root
        import sys
        sys.path.insert(0, "tests/reference")
        from ref_vllm_shim import vllm_backend_class
    cfg = bench_config(mamba_block)
    prompts = workload(n, length, identical)
    vllm_cls = vllm_backend_class()
    # Warm both (imports, caches), then time.
    run_cycles(ReferenceCoreBackend(cfg), prompts[:50])
    run_cycles(vllm_cls(cfg), prompts[:50])
    ref = vll = float("inf")
    for _ in range(repeats):
        ref = min(ref, run_cycles(ReferenceCoreBackend(cfg), prompts))
        vll = min(vll, run_cycles(vllm_cls(cfg), prompts))
    return ref, vll


if __name__ == "__main__":
    for identical in (False, True):
        for length, mb in ((40, 64), (200, 64), (600, 1024)):
            ref, vll = compare(2000, length, identical, mb)
            print(f"len {length} mamba {mb} identical={identical}: reference {2000 / ref:,.0f} "
                  f"cycles/s, vllm {2000 / vll:,.0f} cycles/s, ratio {vll / ref:.2f}")
