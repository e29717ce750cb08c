"""Scheduler role, reuse extension (docs/reuse.md) in isolation: snapshot decisions, bounds,
slot lifetimes (overwrite, release on preemption and finish, flush pins), decode boundary
saves."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import BoundaryPut, Snapshot, TailproofWorkerMeta
from tailproof.impl.scheduler_side import SchedulerSide

H, B = 4, 16
GEO = StoreGeometry(core_group_ids=(0, 1), block_sizes=(B, B), is_mamba=(False, True),
                    hash_block_size=H, scheduler_block_size=B, partial_hits=True, use_eagle=False,
                    num_blocks=64)
ON = Settings(turn_end_checkpoints=True)


class Pool:
    """A stand-in for vLLM's ``BlockPool``: reference counts by id; block 0 is the null
    block; ``get_new_blocks`` hands out the lowest free ids."""

    def __init__(self, n: int = 64) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]

    def get_num_free_blocks(self) -> int:
        return sum(b.ref_cnt == 0 for b in self.blocks[1:])

    def get_new_blocks(self, k: int) -> list[Any]:
        out = [b for b in self.blocks[1:] if b.ref_cnt == 0][:k]
        assert len(out) == k, "pool exhausted"
        for b in out:
            b.ref_cnt = 1
        return out

    def touch(self, blocks: list) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:  # noqa: ANN001
        for b in blocks:
            assert b.ref_cnt > 0, "double release"
            b.ref_cnt -= 1


class Req:
    """The fields of ``vllm.v1.request.Request`` the scheduler role reads."""

    def __init__(self, rid: str, prompt: int) -> None:
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.all_token_ids = list(range(prompt))
        self.num_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        return [bytes([i]) for i in range(self.num_tokens // H)]


class Harness:
    """One SchedulerSide fed hand-built ``SchedulerOutput``s; each request owns a table of
    8 attention and 8 Mamba blocks taken from the pool (so free counts are real)."""

    def __init__(self, settings: Settings = ON, pool_blocks: int = 64) -> None:
        self.side = SchedulerSide(settings, GEO, None, 1)
        self.pool = Pool(pool_blocks)
        self.side.bind_gpu_block_pool(self.pool)
        self.reqs: dict[str, Req] = {}
        self.tables: dict[str, tuple[list[int], list[int]]] = {}

    def add(self, rid: str, prompt: int) -> Req:
        req = self.reqs[rid] = Req(rid, prompt)
        ids = [b.block_id for b in self.pool.get_new_blocks(16)]
        self.tables[rid] = (ids[:8], ids[8:])
        self.side.update_state_after_alloc(req, None, 0)
        return req

    def step(self, new: tuple[str, ...] = (), cached: tuple[str, ...] = (), sched: int = 1,
             finished: tuple[str, ...] = (), preempted: tuple[str, ...] = (),
             offloads: dict[str, list[tuple[int, int, int]]] | None = None,
             spec: dict[str, list[int]] | None = None) -> Any:
        """One step: ``new`` requests prefill ``sched`` tokens from 0, ``cached`` ones compute
        ``sched`` more (their sampled tokens appended after the step, as vLLM does)."""
        nums = {rid: sched for rid in (*new, *cached)}
        new_reqs = [SimpleNamespace(req_id=r, block_ids=self.tables[r], num_computed_tokens=0,
                                    prompt_token_ids=self.reqs[r].all_token_ids,
                                    prefill_token_ids=None) for r in new]
        cr = SimpleNamespace(req_ids=list(cached), resumed_req_ids=set(),
                             new_block_ids=[None] * len(cached),
                             num_computed_tokens=[self.reqs[r].num_computed_tokens
                                                  for r in cached])
        state = SimpleNamespace(get_block_ids=lambda rid: self.tables.get(rid),
                                boundary_state_offloads=offloads or {})
        so = SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                             scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cr,
                             num_scheduled_tokens=nums, kv_connector_block_state=state,
                             scheduled_spec_decode_tokens=spec or {})
        meta = self.side.build_connector_meta(so)
        for rid, n in nums.items():
            req = self.reqs[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.all_token_ids.append(7)
        return meta

    def decode_to(self, rid: str, n: int) -> list[Any]:
        """Decode steps until ``rid`` has ``n`` computed tokens; the metas."""
        metas = []
        while self.reqs[rid].num_computed_tokens < n:
            metas.append(self.step(cached=(rid,)))
        return metas

    def report_all(self) -> None:
        """The worker reports every emitted job (their pins go)."""
        done = dict.fromkeys(self.side.held, 1)
        self.side.update_connector_output(TailproofWorkerMeta(completed_saves=done))

    def refs(self, ids: list[int]) -> list[int]:
        return [self.pool.blocks[b].ref_cnt for b in ids]


def test_snapshot_every_boundary_past_checkpoint_overwrites_one_slot() -> None:
    """P=45, ck=44: snapshots at 48, 52, ... into the same slot; source = the running state
    block of the step's end (``running_state_index``)."""
    t = Harness()
    t.add("r", 45)
    assert t.step(new=("r",), sched=45).snapshots == []
    snaps = [s for m in t.decode_to("r", 53) for s in m.snapshots]
    mamba = t.tables["r"][1]
    slot = snaps[0].slot_block
    assert snaps == [Snapshot("r", 1, mamba[2], slot, 48), Snapshot("r", 1, mamba[3], slot, 52)]
    assert t.side.ext.snapshot_slots() == {"r": ([slot], 52)}
    assert slot not in mamba and t.refs([slot]) == [1]
    assert t.side.metrics.c.total("snapshots_taken") == 2


def test_no_snapshot_at_or_below_checkpoint() -> None:
    """A prefill chunk ending at ck(45)=44 takes none; a prompt ending on a boundary
    (P=48, ck=44) takes one at its end."""
    t = Harness()
    t.add("a", 45)
    assert t.step(new=("a",), sched=44).snapshots == []
    t.add("b", 48)
    assert [s.boundary for s in t.step(new=("b",), sched=48).snapshots] == [48]


def test_slots_bounded_and_reserve_respected() -> None:
    t = Harness(replace(ON, checkpoint_slots=1))
    for rid in ("a", "b"):
        t.add(rid, 48)
    assert [s.req_id for s in t.step(new=("a", "b"), sched=48).snapshots] == ["a"]
    assert t.side.metrics.c.total("snapshots_skipped") == 1
    # 2 requests hold 32 of 63 blocks: 31 free. A reserve of 31 leaves no room for one slot.
    t2 = Harness(replace(ON, checkpoint_reserve_blocks=31))
    t2.add("a", 48)
    t2.add("b", 48)
    assert t2.step(new=("a", "b"), sched=48).snapshots == []
    t3 = Harness(replace(ON, checkpoint_reserve_blocks=30))
    t3.add("a", 48)
    t3.add("b", 48)
    assert [s.req_id for s in t3.step(new=("a", "b"), sched=48).snapshots] == ["a"]


def test_preemption_releases_slots() -> None:
    t = Harness()
    t.add("r", 48)
    slot = t.step(new=("r",), sched=48).snapshots[0].slot_block
    t.step(preempted=("r",))
    assert t.side.ext.snapshot_slots() == {} and t.refs([slot]) == [0]


def test_finish_flush_pins_then_drops_slot_ref() -> None:
    """Rule 3: the job puts the attention blocks from the last normal save (32) up to b=52
    and the slot under 52; it pins them, the connector's own slot ref goes, the job is
    emitted with the next meta and its pins go when the worker reports it."""
    t = Harness()
    req = t.add("r", 45)
    t.step(new=("r",), sched=45)
    t.decode_to("r", 54)
    t.report_all()
    slot = t.side.ext.snapshot_slots()["r"][0][0]
    fa = t.tables["r"][0]
    job = t.side.finish_turn(req, t.tables["r"])
    assert job is not None and t.side.ext.snapshot_slots() == {}
    assert job.token_len_chunk == 0
    assert list(job.boundary_puts) == [BoundaryPut(0, fa[2], 48), BoundaryPut(0, fa[3], 52),
                                 BoundaryPut(1, slot, 52)]
    assert t.refs([slot, fa[2], fa[3]]) == [1, 2, 2]  # the job's pins (the table holds fa)
    meta = t.step(finished=("r",))
    assert [s.store_job_id for s in meta.stores] == [job.store_job_id]
    t.side.update_connector_output(TailproofWorkerMeta(completed_saves={job.store_job_id: 1}))
    assert t.refs([slot, fa[2], fa[3]]) == [0, 1, 1]
    assert t.side.metrics.c.total("turn_end_jobs") == 1


def test_finish_without_flush_releases_slots() -> None:
    """A snapshot past the computed tokens (not flushable) or a dead tracker: no job, slots
    released once."""
    t = Harness()
    req = t.add("r", 48)
    slot = t.step(new=("r",), sched=48).snapshots[0].slot_block
    t.report_all()
    req.num_computed_tokens = 47  # as if the snapshot's step never completed
    assert t.side.finish_turn(req, t.tables["r"]) is None
    assert t.refs([slot]) == [0] and t.side.held == {}
    assert t.side.finish_turn(req, t.tables["r"]) is None  # nothing left to release
    t.step(finished=("r",))
    assert t.refs([slot]) == [0]


def test_null_source_takes_no_snapshot() -> None:
    t = Harness()
    t.add("r", 48)
    t.tables["r"][1][2] = 0  # running state entry for 48 is the null block
    assert t.step(new=("r",), sched=48).snapshots == []
    assert t.side.ext.snapshot_slots() == {}


def test_consumer_and_default_never_snapshot() -> None:
    for settings in (replace(ON, kv_role="kv_consumer"), Settings()):
        t = Harness(settings)
        req = t.add("r", 48)
        assert t.step(new=("r",), sched=48).snapshots == []
        assert t.side.finish_turn(req, t.tables["r"]) is None


def test_speculative_step_disables_the_extension() -> None:
    t = Harness()
    t.add("r", 45)
    t.step(new=("r",), sched=45)
    t.decode_to("r", 49)
    slot = t.side.ext.snapshot_slots()["r"][0][0]
    assert t.step(cached=("r",), spec={"r": [1]}).snapshots == []
    assert t.side.ext.disabled and t.refs([slot]) == [0]
    assert [s for m in t.decode_to("r", 60) for s in m.snapshots] == []


@pytest.mark.parametrize("on", [False, True])
def test_decode_boundary_saves(on: bool) -> None:
    """Rule 5: a decode-time aligned Mamba hand-off at 64 (prefill end 45) is dropped by
    default; with the setting it is put with the attention blocks up to it (from the last
    normal save, 32), attention first."""
    t = Harness(Settings(decode_boundary_saves=on))
    t.add("r", 45)
    t.step(new=("r",), sched=45)
    t.decode_to("r", 64)
    t.report_all()
    fa, mamba = t.tables["r"]
    meta = t.step(cached=("r",), offloads={"r": [(1, mamba[3], 64)]})
    if not on:
        assert meta.stores == []
        return
    (job,) = meta.stores
    assert job.token_len_chunk == 0 and job.completed_token_len == 65
    assert list(job.boundary_puts) == [BoundaryPut(0, fa[2], 48), BoundaryPut(0, fa[3], 64),
                                 BoundaryPut(1, mamba[3], 64)]
    assert t.refs([fa[2], fa[3], mamba[3]]) == [2, 2, 2]
    assert t.side.request_trackers["r"].num_saved_tokens == 32  # keyed puts: offset unmoved


@pytest.mark.parametrize("wait", [True, False])
def test_lookup_waits_for_an_inflight_flush(wait: bool) -> None:
    """Rule 7: a lookup whose prompt extends the boundary an in-flight flush puts (and whose
    hit is below it) is deferred (``None``: vLLM asks again) until the job is reported."""
    from tailproof.impl.lookup import LookupResult

    t = Harness(replace(ON, checkpoint_lookup_wait=wait))
    req = t.add("r", 45)
    t.step(new=("r",), sched=45)
    t.decode_to("r", 53)
    t.report_all()
    job = t.side.finish_turn(req, t.tables["r"])
    assert job is not None
    nxt = Req("n", 60)  # the stand-in's hashes are positional: it extends "r"'s prefix 52
    store_hit = [44]
    t.side.lookup_client = SimpleNamespace(
        lookup=lambda n, hashes: LookupResult(store_hit[0], ()))
    t.side.update_state_after_alloc(nxt, None, 0)
    assert t.side.get_num_new_matched_tokens(nxt, 0) == ((None, False) if wait else (44, True))
    short = Req("s", 50)  # its prompt ends before 52: nothing to wait for
    assert t.side.get_num_new_matched_tokens(short, 0) == (44, True)
    t.step(finished=("r",))
    still = t.side.get_num_new_matched_tokens(nxt, 0)  # emitted, not reported yet
    assert still == ((None, False) if wait else (44, True))
    t.report_all()
    store_hit[0] = 52
    assert t.side.get_num_new_matched_tokens(nxt, 0) == (52, True)
    assert t.side.metrics.c.total("lookups_deferred") == (2 if wait else 0)


def test_async_scheduling_placeholder_counts_as_computed() -> None:
    """Under async scheduling (vLLM 0.33's default) a decode step is scheduled before the
    previous step's token is appended: the request has num_tokens == computed, yet the step's
    forward still ends one token later -- the snapshot is keyed there (48), not at 47."""
    t = Harness()
    req = t.add("r", 45)
    t.step(new=("r",), sched=45)
    t.decode_to("r", 47)
    req.all_token_ids.pop()  # the token step 47 samples is still in flight
    assert req.num_tokens == req.num_computed_tokens == 47
    (snap,) = t.step(cached=("r",)).snapshots
    assert (snap.boundary, snap.src_block) == (48, t.tables["r"][1][2])


def test_consumer_sets_no_junction() -> None:
    """A consumer stores nothing, so it never stops a chunk at a junction it could not store:
    no prompt index, and the lookup leaves ``shared_prefix_boundary`` alone."""
    on = Settings(junction_checkpoints=True)
    assert SchedulerSide(on, GEO, None, 1).ext.junctions is not None
    side = SchedulerSide(replace(on, kv_role="kv_consumer"), GEO, None, 1)
    side.ext.junction_hook_ran(vllm_keys_junctions=False)
    assert side.ext.junctions is None
    req = SimpleNamespace(request_id="B", num_tokens=40, num_prompt_tokens=40,
                          block_hashes=[bytes([i]) for i in range(10)], shared_prefix_boundary=0)
    assert side.get_num_new_matched_tokens(req, 16) == (0, False)
    assert req.shared_prefix_boundary == 0 and not side.ext.junction_stops()
