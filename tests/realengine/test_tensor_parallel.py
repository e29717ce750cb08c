"""Tensor parallel 2 in vLLM's real engine (the ``mp`` executor: one worker process per rank,
gloo between them; the engine core in the bed process) with ``TailproofConnector`` on a real
Mooncake master on 127.0.0.1, against a TP=2 engine with prefix caching off.

Each rank saves and loads its own slice (its heads and Mamba channels: keys carry the rank, a
rank that loaded another's slice would change the tokens). A hit needs every rank's value: one
rank's values missing, no rank loads; one rank's values corrupt, that rank's verification
fails and vLLM recomputes the request on every rank. A save's pins last until both ranks have
stored the blocks: rank 1's puts held, rank 0's done, the blocks stay pinned, waiting for one
worker. The memory store cannot serve TP=2 (one process's store, several worker processes):
the connector refuses it at start-up (``impl/config.py`` ``check_store_placement``, tested in
``tests/impl/test_vllm_scheduler.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm, pytest.mark.mooncake]

TP = 2
MAX_TOKENS = oracle.MAX_TOKENS
PROMPTS = oracle.shared_prefix_prompts(seed=2, lengths=(40, 64, 150, 288, 400))
MC_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def truth() -> list[tuple[int, ...]]:
    return oracle.ground_truth(PROMPTS, MAX_TOKENS, tb.EngineSpec(
        prefix_caching=False, executor="mp", tensor_parallel_size=TP))


@pytest.fixture(scope="module")
def bed(master: Any, truth: list) -> Iterator[tb.Bed]:
    kt = tb.tailproof_connector({"store": "mooncake", "master_address": master.address,
                                 "namespace": "rt-tp2", "global_segment_size": 64 << 20,
                                 # a loaded 2-core machine: a slow master RPC must not turn
                                 # the corrupt-value check into a timeout check
                                 "rpc_timeout_ms": 30_000})
    spec = tb.EngineSpec(kv_transfer_config=kt, executor="mp", tensor_parallel_size=TP,
                         max_num_batched_tokens=256, env=dict(MC_ENV))
    with tb.Bed(spec) as b:
        yield b


def _equal(truth: list, got: list[tb.Completion], name: str) -> None:
    res = oracle.compare(truth, got, name)
    assert res.ok, f"{name} differs from the TP=2 engine without prefix caching:\n" + \
        "\n".join(res.differences)


def _delta(before: list[dict[str, int]], after: list[dict[str, int]], key: str) -> list[int]:
    """Per rank: how much counter ``key`` grew."""
    return [a.get(key, 0) - b.get(key, 0) for b, a in zip(before, after, strict=True)]


def _fill(bed: tb.Bed, truth: list) -> list[tb.Completion]:
    """A fresh key epoch (and an empty device cache), the workload once, every save done."""
    assert bed.call(tb.drain_store_jobs, 120.0)
    bed.reset_prefix_cache(reset_connector=True)
    got = bed.generate(PROMPTS, MAX_TOKENS)
    _equal(truth, got, "fill")
    assert bed.call(tb.drain_store_jobs, 120.0)
    return got


def _rank_keys(master: Any, epoch: str, rank: int) -> list[str]:
    """The master's keys of this epoch stored by tensor-parallel rank ``rank``."""
    from tailproof.impl.keys import parse_key

    out = []
    for key in master.keys():
        try:
            p = parse_key(key)
        except ValueError:
            continue
        if p.epoch == epoch and p.tp_rank == rank:
            out.append(key)
    return out


def test_passes_equal_a_tp2_engine_without_prefix_caching(bed: tb.Bed, truth: list) -> None:
    before = bed.worker(tb.connector_counters)
    passes = oracle.run_passes(bed, PROMPTS, MAX_TOKENS)
    for name, got in passes.items():
        _equal(truth, got, name)
    assert all(c.num_cached_tokens for c in passes["store-hit"])
    after = bed.worker(tb.connector_counters)
    assert len(after) == TP
    assert all(n > 0 for n in _delta(before, after, "put_keys")), after  # every rank saves
    assert all(n > 0 for n in _delta(before, after, "get_keys")), after  # and loads
    assert bed.worker(tb.tp_rank) == list(range(TP))


def test_a_block_stays_pinned_until_both_ranks_stored_it(bed: tb.Bed, truth: list) -> None:
    assert bed.call(tb.drain_store_jobs, 120.0)
    bed.reset_prefix_cache(reset_connector=True)
    before = bed.worker(tb.connector_counters)
    assert bed.worker(tb.hold_store_puts, 1) == [False, True]
    try:
        _equal(truth, bed.generate(PROMPTS, MAX_TOKENS), "rank 1's puts held")
        # rank 0 finishes its saves (waited for, however long a loaded machine takes) and
        # reports them; rank 1's stay queued behind the gate, not waited for
        assert bed.worker(tb.wait_connector_idle, 120.0, 0) == [True, True]
        assert not bed.call(tb.drain_store_jobs, 0.0)
        pins = bed.call(tb.scheduler_pins)
        mid = bed.worker(tb.connector_counters)
    finally:
        assert bed.worker(tb.release_store_puts) == [False, True]
    assert pins["pinned_blocks"] > 0 and pins["held"], pins
    assert set(pins["held"].values()) == {1}, pins  # every held job waits for one worker
    put0, put1 = _delta(before, mid, "put_keys")
    assert put0 > 0 and put1 == 0, mid
    assert bed.call(tb.drain_store_jobs, 120.0)  # rank 1 stores, reports: pins released
    pins = bed.call(tb.scheduler_pins)
    assert pins["pinned_blocks"] == 0 and not pins["held"], pins
    bed.reset_prefix_cache()
    got = bed.generate(PROMPTS, MAX_TOKENS)
    _equal(truth, got, "store-hit after the held puts")
    assert all(c.num_cached_tokens for c in got)


def test_one_ranks_missing_values_fail_the_hit_closed_on_every_rank(
        bed: tb.Bed, master: Any, truth: list) -> None:
    filled = _fill(bed, truth)
    keys = _rank_keys(master, bed.call(tb.scheduler_pins)["epoch"], 1)
    assert keys
    assert sum(bed.worker(tb.remove_store_values, keys, 1)) == len(keys)
    bed.reset_prefix_cache()
    before = bed.worker(tb.connector_counters)
    got = bed.generate(PROMPTS, MAX_TOKENS)
    after = bed.worker(tb.connector_counters)
    _equal(truth, got, "rank 1's values missing")
    assert _delta(before, after, "get_keys") == [0] * TP, after  # no rank loaded
    # only the batch's own device sharing, as on the fill pass (same device state)
    assert [c.num_cached_tokens for c in got] == [c.num_cached_tokens for c in filled]


def test_one_ranks_corrupt_values_fail_closed_on_every_rank(
        bed: tb.Bed, master: Any, truth: list) -> None:
    _fill(bed, truth)
    keys = _rank_keys(master, bed.call(tb.scheduler_pins)["epoch"], 1)
    assert keys
    assert sum(bed.worker(tb.corrupt_store_values, None, keys, 1)) == len(keys)
    bed.reset_prefix_cache()
    before, failed_before = bed.worker(tb.connector_counters), bed.call(tb.scheduler_pins)
    got = bed.generate(PROMPTS, MAX_TOKENS)
    after, failed_after = bed.worker(tb.connector_counters), bed.call(tb.scheduler_pins)
    _equal(truth, got, "rank 1's values corrupt")
    fails = [sum(a.get(k, 0) - b.get(k, 0) for k in a if k.startswith("verify_fail"))
             for b, a in zip(before, after, strict=True)]
    assert fails[0] == 0 and fails[1] > 0, (fails, json.dumps(after))
    assert failed_after["loads_failed"] > failed_before["loads_failed"]  # recomputed
