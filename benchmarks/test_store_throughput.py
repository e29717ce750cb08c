"""pytest-benchmark: save/load of one 1024-token hybrid chunk (65.4 MiB, 28 values) per store.

Geometry and the plain-script version: benchmarks/store_throughput.py. Run:

    .venv/bin/python -m pytest benchmarks/test_store_throughput.py --benchmark-only

Each store benchmark also measures a torch copy of the same bytes in the same test and records
``ratio_vs_torch_copy`` in ``extra_info``; the memory store must reach >= 0.5 (the goal).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.store_throughput import Chunk, check_all_ok, make_chunk, median_seconds
from tailproof.impl.stores import MemoryStore, Store, make_store

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
ROUNDS = 10
MEMORY_GOAL = 0.5  # memory store >= half the rate of a plain torch copy


@pytest.fixture(scope="module")
def chunk() -> Chunk:
    return make_chunk()


@pytest.fixture(scope="module")
def copy_seconds(chunk: Chunk) -> float:
    """Median time of a torch copy of the chunk's bytes into a preallocated tensor."""
    dst = torch.empty_like(chunk.staging)
    return median_seconds(lambda: dst.copy_(chunk.staging), rounds=ROUNDS)


@pytest.fixture(scope="module")
def mooncake_store(chunk: Chunk) -> Iterator[Store]:
    from tailproof.conformance.harness.local_master import LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with LocalMaster() as master, make_store(
            {"backend": "mooncake", "master_address": master.address,
             "global_segment_size": "512MB", "local_buffer_size": "16MB"}) as store:
        store.register_buffer(chunk.staging)  # once, as the connector does
        yield store
        store.unregister_buffer(chunk.staging)


def _record(benchmark: Any, chunk: Chunk, copy_s: float) -> float:
    median = benchmark.stats.stats.median
    ratio = copy_s / median
    benchmark.extra_info.update(bytes=chunk.nbytes, gb_per_s=round(chunk.nbytes / median / 1e9, 3),
                                torch_copy_gb_per_s=round(chunk.nbytes / copy_s / 1e9, 3),
                                ratio_vs_torch_copy=round(ratio, 3))
    return ratio


def _bench_put(benchmark: Any, store: Store, chunk: Chunk) -> None:
    def empty() -> None:  # untimed; must return None (pytest-benchmark reads a result as args)
        store.remove_all()

    benchmark.pedantic(lambda: check_all_ok(store.put_batch(chunk.keys, chunk.views)),
                       setup=empty, rounds=ROUNDS, warmup_rounds=1)


def _bench_get(benchmark: Any, store: Store, chunk: Chunk) -> None:
    store.remove_all()
    check_all_ok(store.put_batch(chunk.keys, chunk.views))
    out = torch.empty_like(chunk.staging)
    views = [out[v.storage_offset():v.storage_offset() + v.numel()] for v in chunk.views]
    benchmark.pedantic(lambda: check_all_ok(store.get_batch(chunk.keys, views)),
                       rounds=ROUNDS, warmup_rounds=1)
    assert torch.equal(out, chunk.staging)


def test_torch_copy_baseline(benchmark: Any, chunk: Chunk) -> None:
    dst = torch.empty_like(chunk.staging)
    benchmark.pedantic(lambda: dst.copy_(chunk.staging), rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(bytes=chunk.nbytes)


def test_memory_put(benchmark: Any, chunk: Chunk, copy_seconds: float) -> None:
    with MemoryStore(1 << 30) as store:
        _bench_put(benchmark, store, chunk)
    assert _record(benchmark, chunk, copy_seconds) >= MEMORY_GOAL


def test_memory_get(benchmark: Any, chunk: Chunk, copy_seconds: float) -> None:
    with MemoryStore(1 << 30) as store:
        _bench_get(benchmark, store, chunk)
    assert _record(benchmark, chunk, copy_seconds) >= MEMORY_GOAL


def test_mooncake_loopback_put(benchmark: Any, chunk: Chunk, copy_seconds: float,
                               mooncake_store: Store) -> None:
    _bench_put(benchmark, mooncake_store, chunk)
    _record(benchmark, chunk, copy_seconds)


def test_mooncake_loopback_get(benchmark: Any, chunk: Chunk, copy_seconds: float,
                               mooncake_store: Store) -> None:
    _bench_get(benchmark, mooncake_store, chunk)
    _record(benchmark, chunk, copy_seconds)
