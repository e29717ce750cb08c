"""An allocate/free-heavy workload run through the ``CoreBackend`` interface, so the reference
model and the installed vLLM's ``KVCacheManager`` do exactly the same calls in the same order
(the trace config names the installed release, so the reference follows its rules)."""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.trace import FORMAT_TAG, parse_trace

CONFIG: dict[str, Any] = {
    "groups": [{"kind": "full_attention", "block_size": 16},
               {"kind": "mamba_align", "block_size": 64}],
    "hash_block_size": 16, "num_blocks": 1024,
}


def trace_config() -> Any:
    """The workload's config, for the installed vLLM release (0.33 when none is installed)."""
    from tailproof.conformance.harness.releases import installed_release

    config = {**CONFIG, "vllm": installed_release() or "0.33"}
    return parse_trace({"format": FORMAT_TAG, "config": config, "ops": []}).config


def prompts(n: int, length: int = 200, shared: int = 120) -> list[list[int]]:
    """n prompts sharing a ``shared``-token prefix (so lookups hit and CoW happens)."""
    base = list(range(shared))
    return [base + [1000 + i * 7 + j for j in range(length - shared)] for i in range(n)]


def add_all(backend: Any, reqs: list[list[int]]) -> list[str]:
    """Create and hash every request up front (untimed: request hashing is not the manager)."""
    rids = [f"q{i}" for i in range(len(reqs))]
    for rid, p in zip(rids, reqs, strict=True):
        backend.add_request(rid, p, 1)
    return rids


def cycle(backend: Any, rid: str) -> None:
    """One request's life as the scheduler drives it: lookup, Mamba-aligned chunks, drains,
    retention release, finish."""
    backend.new_step()
    hit, _ = backend.lookup(rid, None)
    first = True
    while True:
        view = backend.get(rid)
        start = view.num_computed_tokens + (hit if first else 0)
        if start >= view.num_tokens:
            break
        n = backend.plan_chunk(rid, view.num_tokens - start, hit if first else 0, 0)
        if backend.allocate(rid, n, use_hit=first, external=0, delay_cache=False,
                            lookahead=0) is None:
            raise RuntimeError("pool exhausted")
        first = False
        backend.drain_offloads()
        _, retained = backend.drain_copies()
        if retained:
            backend.release(retained)
        backend.set_counters(rid, num_computed_tokens=backend.get(rid).num_computed_tokens + n)
        backend.new_step()
    backend.finalize_tail(rid)
    backend.free(rid)


def run(backend: Any, rids: list[str]) -> None:
    for rid in rids:
        cycle(backend, rid)


def prepared(cls: Any, reqs: list[list[int]]) -> tuple[Any, list[str]]:
    """A fresh backend with every request added: the argument pair of ``run``."""
    backend = cls(trace_config())
    return backend, add_all(backend, reqs)
