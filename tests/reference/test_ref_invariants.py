"""Invariants (docs/spec.md, section 4) checked after every op of random scheduler-like traces
run on the reference alone (no vLLM needed): I1 refcount accounting, I2 free-queue
membership, I4 key-map consistency."""

from __future__ import annotations

from collections import Counter

import pytest
from ref_fuzz import gen_chaos_trace, gen_trace

from tailproof.conformance.format.trace import parse_trace
from tailproof.conformance.harness.adapters import make_driver
from tailproof.conformance.harness.driver import CoreDriver


def check_invariants(driver: CoreDriver) -> None:
    core = driver.core
    manager = core.manager
    pool = manager.block_pool
    holders: Counter[int] = Counter()
    for m in manager.coordinator.managers:
        for table in m.req_to_blocks.values():
            holders.update(b.block_id for b in table if not b.is_null)
        for src, dst in m._pending_cow_copies:
            holders.update((src.block_id, dst.block_id))
    for ids in driver.retained.values():
        holders.update(ids)
    queue = set(pool.free_block_queue.block_ids())
    assert 0 not in queue
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], f"I1 block {b.block_id}"
        assert (b.block_id in queue) == (b.ref_cnt == 0), f"I2 block {b.block_id}"
    for key, blocks in pool.cached_block_hash_to_block.items():
        assert blocks
        for bid, b in blocks.items():
            assert b.block_id == bid
            assert b.block_hash == key or key in pool.cached_block_hashes_by_block.get(bid, ())
    for b in pool.blocks:
        if b.block_hash is not None:
            assert b.block_id in pool.cached_block_hash_to_block[b.block_hash], "I4 primary"
        for key in pool.cached_block_hashes_by_block.get(b.block_id, ()):
            assert b.block_hash is not None, "I4 secondary without primary"
            assert b.block_id in pool.cached_block_hash_to_block[key], "I4 secondary"


@pytest.mark.parametrize("seed", range(25))
def test_invariants_hold_on_random_traces(seed: int) -> None:
    trace = parse_trace(gen_trace(seed, num_ops=150))
    driver = make_driver("reference", trace.config)
    for op in trace.ops:
        driver.apply(op)
        check_invariants(driver)


@pytest.mark.parametrize("seed", range(25))
def test_invariants_hold_on_chaos_traces(seed: int) -> None:
    """Ops in any order, including ones that raise. An allocation that trips an assertion
    midway (e.g. a stale hit whose block was since reused fails ``_apply_cow``'s check after the
    CoW target was popped) leaks a reference exactly as vLLM does; checking stops there."""
    trace = parse_trace(gen_chaos_trace(seed, num_ops=150))
    driver = make_driver("reference", trace.config)
    for op in trace.ops:
        obs = driver.apply(op)
        assert obs is not None
        if op["op"] == "allocate" and obs.get("error") == "AssertionError":
            break
        check_invariants(driver)


@pytest.mark.parametrize("seed", range(5))
def test_reference_is_deterministic(seed: int) -> None:
    """I20: the same op sequence gives the same ids, queue order and hand-offs."""
    trace = parse_trace(gen_trace(seed, num_ops=150))
    runs = []
    for _ in range(2):
        driver = make_driver("reference", trace.config)
        runs.append([driver.apply(op) for op in trace.ops])
    assert runs[0] == runs[1]
