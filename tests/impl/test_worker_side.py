"""Worker data path: blocks out to the store and back, byte for byte, and every failure closed."""

from __future__ import annotations

import pytest
import torch
from worker_geometry import GEO, HASHES, NB, SHAPES, TOKENS

from tailproof.conformance.harness.adapters.runner_sim import GroupShape, SimRunner
from tailproof.impl.config import Settings
from tailproof.impl.kv_layout import KVLayout, block_view
from tailproof.impl.meta import (
    BoundaryPut,
    LoadJob,
    StoreJob,
    TailKeyBoundary,
    TailproofMeta,
)
from tailproof.impl.stores import MemoryStore, Outcome, Status
from tailproof.impl.worker_side import WorkerSide


def settle(w: WorkerSide) -> None:
    """Wait for the worker's background loads and store jobs (they run off the step)."""
    assert w.wait_idle(30.0)


def make_worker(store: MemoryStore, rank: int = 0, world: int = 1, device: str = "cpu",
                **kw: int) -> tuple[WorkerSide, SimRunner]:
    runner = SimRunner(SHAPES, NB, rank=rank, device=device)
    w = WorkerSide(Settings(**kw), GEO, store, rank, world)
    w.register_kv_caches(runner.kv, runner.layer_names)
    return w, runner


def test_block_view_of_vllm_page_views() -> None:
    """vLLM 0.33 registers 4D [B*r, H, N, C] page views (kernel blocks merged along N) and raw
    int8 Mamba pages; anything without a block axis is refused with its shape named."""
    att = torch.zeros(64, 2, 8, 6)  # 32 blocks, 2 kernel blocks each
    assert tuple(block_view(att, 32).shape) == (32, 2, 2, 8, 24)
    assert tuple(block_view(torch.zeros(32, 1, 1, 40, dtype=torch.int8), 32).shape) == (
        32, 1, 1, 1, 40)
    assert tuple(block_view(torch.zeros(32, 7), 32).shape) == (32, 28)  # a legacy state tensor
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        block_view(torch.zeros(3, 5), 32)
    with pytest.raises(ValueError, match="kernel-block"):
        block_view(torch.zeros(64, 7), 32)


def test_value_does_not_depend_on_kernel_split_or_stride_order() -> None:
    """Issue 20 item 1: the same KV under kernel split 1 / 4 and layouts LBNHC / LBHNC gives
    one canonical value per block (so differing engines share safely), and a value written
    into one layout reads back identically from the others."""
    shapes = [GroupShape("full_attention", 64), GroupShape("mamba", 64)]
    runners = [SimRunner(shapes, 16, layout=lay, kernel_split=r)
               for lay, r in (("LBNHC", 1), ("LBNHC", 4), ("LBHNC", 2), ("BLHNC", 1))]
    assert {tuple(x.kv["g0.l0"].shape) for x in runners} == {(16, 1, 64, 8), (64, 1, 16, 8),
                                                              (32, 1, 32, 8)}
    tables = ([3], [5])
    layouts = []
    for x in runners:
        x.forward("A", TOKENS, 0, 40, tables)
        layouts.append(KVLayout(x.kv, x.layer_names, 16))
    values = [[lay.gather(g, [b]) for g, b in ((0, 3), (1, 5))] for lay in layouts]
    assert all(torch.equal(v[g], values[0][g]) for v in values for g in (0, 1))
    assert runners[0].check_block_bytes(0, values[0][0], TOKENS, 40, "A") == []
    for x, lay in zip(runners, layouts, strict=True):
        lay.scatter(0, [9], values[0][0])
        lay.scatter(1, [10], values[0][1])
        assert x.check("A", TOKENS, 0, 40, ([9], [10])) == []


def test_layout_gather_scatter_roundtrip_with_kernel_blocks() -> None:
    a = torch.randn(64, 1, 8, 8)  # logical block = 2 kernel blocks of 8 tokens
    m = torch.randn(32, 1, 1, 3 * 4 + 5 * 8).to(torch.int8)
    lay = KVLayout({"a": a, "m": m}, [["a"], ["m"]], 32)
    assert lay.block_nbytes == [2 * 8 * 8 * 4, 3 * 4 + 5 * 8]
    assert lay.layer_page_shapes == {"a": (1, 16, 32), "m": (1, 1, 52)}
    data = lay.gather(0, [3, 7]).clone()
    data1 = lay.gather(1, [5]).clone()
    a2 = a.clone()
    lay.scatter(0, [10, 11], data)
    lay.scatter(1, [9], data1)
    assert torch.equal(a[20:22], a2[6:8]) and torch.equal(a[22:24], a2[14:16])
    assert torch.equal(m[9], m[5])


def test_a_shared_layer_view_is_stored_once() -> None:
    """Cross-layer KV sharing registers the target's view under a second name
    (``initialize_kv_cache_tensors``): the value holds its bytes once."""
    a = torch.randn(32, 1, 16, 8)
    lay = KVLayout({"x": a, "y": a}, [["x", "y"]], 32)
    assert lay.block_nbytes == [16 * 8 * 4] and lay.aliases == {"y": "x"}


def save(job: int, rid: str, token_len: int, tables: tuple[list[int], ...],
         hashes: list[bytes], puts: list[BoundaryPut]) -> StoreJob:
    return StoreJob(store_job_id=job, req_id=rid, token_len_chunk=token_len, block_ids=tables,
                    block_hashes=hashes, boundary_puts=puts)


def load_b(tables: tuple[list[int], ...]) -> LoadJob:
    """Request B loads [0, 44) with both groups keyed at 44."""
    return LoadJob(req_id="B", block_ids=tables, block_hashes=HASHES, vllm_cached_tokens=0,
                   kvpool_cached_tokens=44,
                   tail_key_boundaries=(TailKeyBoundary(0, 44), TailKeyBoundary(1, 44)))


def produce(w: WorkerSide, runner: SimRunner, rid: str, end: int, tables: tuple[list[int], ...],
            puts: list[BoundaryPut], token_len: int, job: int = 0) -> None:
    runner.forward(rid, TOKENS, 0, end, tables)
    w.wait_for_save(TailproofMeta(stores=[
        save(job, rid, token_len, tables, HASHES, puts)]))
    settle(w)


def test_save_then_load_is_byte_exact_and_reports_jobs() -> None:
    store = MemoryStore()
    w, runner = make_worker(store)
    # Producer computed 44 tokens: FA blocks 1,2,3 (0..47), Mamba state@44 in block 6.
    tables = ([1, 2, 3], [0, 0, 6])
    puts = [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)]
    produce(w, runner, "A", 44, tables, puts, token_len=32)
    assert w.build_connector_worker_meta().completed_saves == {0: 1}
    assert w.build_connector_worker_meta() is None
    # 2 full FA blocks + FA tail@44 + Mamba@44.
    assert len(store._data) == 4
    # Consumer: fresh worker state, other blocks; load 44 tokens.
    w2, r2 = make_worker(store)
    ctab = ([7, 8, 9], [0, 0, 10])
    w2.start_load(TailproofMeta(loads=[load_b(ctab)]))
    settle(w2)
    assert w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 0, 44, ctab) == []


def test_load_reads_cow_target_not_source() -> None:
    """A boundary put of the CoW target stores the state at the boundary, not the source's
    later state: reading the source would be a byte mismatch."""
    store = MemoryStore()
    w, runner = make_worker(store)
    tables = ([1, 2, 3], [0, 0, 6])
    runner.forward("A", TOKENS, 0, 44, tables)
    runner.copy_blocks([(6, 12)])  # running CoW: target 12 keeps state@44
    runner.forward("A", TOKENS, 44, 45, tables)  # source 6 moves on to state@45
    w.wait_for_save(TailproofMeta(stores=[save(
        0, "A", 32, tables, HASHES, [BoundaryPut(0, 3, 44), BoundaryPut(1, 12, 44)])]))
    settle(w)
    w2, r2 = make_worker(store)
    ctab = ([7, 8, 9], [0, 0, 10])
    w2.start_load(TailproofMeta(loads=[load_b(ctab)]))
    settle(w2)
    assert w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 0, 44, ctab) == []
    # The same put from the source block would be detected.
    store2 = MemoryStore()
    w3, r3 = make_worker(store2)
    r3.forward("A", TOKENS, 0, 45, tables)
    w3.wait_for_save(TailproofMeta(stores=[save(
        0, "A", 32, tables, HASHES, [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)])]))
    settle(w3)
    w4, r4 = make_worker(store2)
    w4.start_load(TailproofMeta(loads=[load_b(ctab)]))
    settle(w4)
    assert w4.take_transfer_results() == ({"B"}, set())
    assert r4.check("B", TOKENS, 0, 44, ctab) != []


@pytest.mark.parametrize("status", [Status.MISS, Status.ERROR, Status.TIMEOUT, Status.TOO_LARGE])
def test_failed_get_fails_closed(status: Status) -> None:
    store = MemoryStore()
    w, runner = make_worker(store)
    tables = ([1, 2, 3], [0, 0, 6])
    produce(w, runner, "A", 44, tables, [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)], 32)
    w2, r2 = make_worker(store)
    ctab = ([7, 8, 9], [0, 0, 10])
    store.faults.script("get", [None, Outcome(status)])
    w2.start_load(TailproofMeta(loads=[load_b(ctab)]))
    settle(w2)
    done, failed = w2.take_transfer_results()
    assert done == {"B"} and failed == {"B"}
    # Nothing was scattered: the blocks still hold zeros, never partial KV.
    assert not any(r2.kv["g0.l0"][b].any() for b in (7, 8, 9))
    assert w2.metrics.c.get(f"get_fail_{status.value}") == 1


def test_pressure_gate_skips_then_clears() -> None:
    store = MemoryStore()
    w, runner = make_worker(store)
    tables = ([1, 2, 3], [0, 0, 6])
    runner.forward("A", TOKENS, 0, 48, tables)
    runner.forward("B", TOKENS[::-1], 0, 48, ([4, 5, 6], [0, 0, 9]))
    store.faults.script("put", [Outcome.full(-200)])
    job = save(0, "A", 32, tables, HASHES, [])
    w.wait_for_save(TailproofMeta(stores=[job]))
    settle(w)
    assert w.gate.store_pressure_active and w.gate.skip_store_requests == {"A"}
    assert w.saved_offset.get("A") is None
    puts_before = w.metrics.c.get("put_keys")
    w.wait_for_save(TailproofMeta(stores=[save(1, "A", 48, tables, HASHES, [])]))
    settle(w)
    assert w.metrics.c.get("put_keys") == puts_before  # skipped: zero puts
    assert w.metrics.c.get("jobs_skipped_pressure") == 1
    hb = [bytes([200 + i]) * 8 for i in range(12)]
    w.wait_for_save(TailproofMeta(stores=[save(2, "B", 48, ([4, 5, 6], [0, 0, 9]), hb, [])]))
    settle(w)
    assert not w.gate.store_pressure_active and not w.gate.skip_store_requests
    w.wait_for_save(TailproofMeta(stores=[save(3, "A", 48, tables, HASHES, [])]))
    settle(w)
    assert w.saved_offset["A"] == 48  # resumed from offset 0
    assert w.build_connector_worker_meta().completed_saves == {0: 1, 1: 1, 2: 1, 3: 1}


def test_failed_boundary_put_skips_normal_save() -> None:
    store = MemoryStore()
    w, runner = make_worker(store)
    tables = ([1, 2, 3], [0, 0, 6])
    runner.forward("A", TOKENS, 0, 44, tables)
    store.faults.script("put", [Outcome.error()])
    w.wait_for_save(TailproofMeta(stores=[save(0, "A", 32, tables, HASHES,
                                                   [BoundaryPut(1, 6, 44)])]))
    settle(w)
    assert w.saved_offset.get("A") is None and not store._data
    assert w.build_connector_worker_meta().completed_saves == {0: 1}


def test_two_ranks_store_their_own_shards() -> None:
    store = MemoryStore()
    tables = ([1, 2, 3], [0, 0, 6])
    for rank in (0, 1):
        w, runner = make_worker(store, rank=rank, world=2)
        produce(w, runner, "A", 44, tables, [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)], 32)
    assert len(store._data) == 8
    for rank in (0, 1):
        w, r = make_worker(store, rank=rank, world=2)
        ctab = ([7, 8, 9], [0, 0, 10])
        w.start_load(TailproofMeta(loads=[load_b(ctab)]))
        settle(w)
        assert w.take_transfer_results() == ({"B"}, set())
        assert r.check("B", TOKENS, 0, 44, ctab) == []


def test_small_staging_buffer_puts_in_batches() -> None:
    store = MemoryStore()
    w, runner = make_worker(store, put_batch_size=1)
    tables = ([1, 2, 3], [0, 0, 6])
    produce(w, runner, "A", 48, tables, [], token_len=48)
    assert w.metrics.c.get("put_batches") == 3 and w.saved_offset["A"] == 48
    # Re-saving stores nothing new (keys exist) and still succeeds.
    w.saved_offset.clear()
    w.wait_for_save(TailproofMeta(stores=[save(1, "A", 48, tables, HASHES, [])]))
    settle(w)
    assert w.metrics.c.get("put_keys") == 3


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU: the CUDA data path (pinned staging, step event) needs one")
def test_cuda_kv_roundtrip_with_pinned_staging() -> None:
    """KV tensors on the GPU: pinned staging pool, the step's event orders the sender's
    device-to-host copies after the forward and CoW copies, loads copied back on the copy
    stream; byte-exact both ways."""
    store = MemoryStore()
    w, runner = make_worker(store, device="cuda")
    assert w.pool is not None and w.pool.pin and w.copy_stream is not None
    with w.pool.take(64) as buf:
        assert buf.is_pinned()  # page-locked: the device-to-host copies run asynchronously
    tables = ([1, 2, 3], [0, 0, 6])
    runner.forward("A", TOKENS, 0, 44, tables)
    runner.copy_blocks([(6, 12)])
    runner.forward("A", TOKENS, 44, 45, tables)
    w.wait_for_save(TailproofMeta(stores=[save(
        0, "A", 32, tables, HASHES, [BoundaryPut(0, 3, 44), BoundaryPut(1, 12, 44)])]))
    settle(w)
    w2, r2 = make_worker(store, device="cuda")
    ctab = ([7, 8, 9], [0, 0, 10])
    w2.start_load(TailproofMeta(loads=[load_b(ctab)]))
    settle(w2)
    assert w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 0, 44, ctab) == []


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: the step-stream ordering needs one")),
])
def test_snapshot_copy_then_flush_is_byte_exact(device: str) -> None:
    """docs/reuse.md rules 2-3 on the worker: the step ending at 52 has its running Mamba state
    (block 6) copied into slot 20 in ``wait_for_save``; later steps overwrite block 6 in place;
    the flush job, queued steps later, puts slot 20 under 52 and a load at 52 is byte-exact
    (on a GPU the copy and the forwards are ordered on the step's stream)."""
    from tailproof.impl.meta import Snapshot

    store = MemoryStore()
    w, runner = make_worker(store, device=device)
    tables = ([1, 2, 3, 4], [0, 0, 0, 6])
    runner.forward("A", TOKENS, 0, 52, tables)
    w.wait_for_save(TailproofMeta(snapshots=[Snapshot("A", 1, 6, 20, 52)]))
    assert w.metrics.c.total("snapshot_copy_bytes") == w.layout.block_nbytes[1]
    for end in (53, 54, 55):  # decode steps overwrite the running state block
        runner.forward("A", TOKENS, end - 1, end, tables)
        w.wait_for_save(TailproofMeta())
    flush = save(0, "A", 0, tables, HASHES, [BoundaryPut(0, 4, 52), BoundaryPut(1, 20, 52)])
    w.wait_for_save(TailproofMeta(stores=[flush], finished_req_ids={"A"}))
    settle(w)
    assert w.completed_saves == {0: 1}
    w2, r2 = make_worker(store, device=device)
    ctab = ([7, 8, 9, 10], [0, 0, 0, 11])
    w2.start_load(TailproofMeta(loads=[LoadJob(
        req_id="B", block_ids=ctab, block_hashes=HASHES, vllm_cached_tokens=48,
        kvpool_cached_tokens=52, tail_key_boundaries=(TailKeyBoundary(0, 52),
                                                      TailKeyBoundary(1, 52)))]))
    settle(w2)
    assert w2.take_transfer_results() == ({"B"}, set())
    assert r2.check("B", TOKENS, 48, 52, ctab) == []
    assert r2.check("B", TOKENS, 48, 53, ctab) != []  # the check tells the states apart
