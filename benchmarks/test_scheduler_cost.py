"""Scheduler-side per-step cost: TailproofConnector's scheduler role vs the installed vLLM's
(0.33 or 0.34) ``MooncakeStoreScheduler``, replaying the same recorded connector-call trace
(pytest-benchmark).

Each trace is recorded once from vLLM's real ``Scheduler`` driving ``TailproofConnector`` on CPU
(``tests/impl/engine_sim.py``): a multi-turn, prefix-sharing workload (32 conversations x 4
turns, and 96 x 3) on a hybrid layout
(full attention 16 + Mamba 64, h = 16, so partial tails, CoW hand-offs and store jobs occur).
Every scheduler -> connector call is snapshotted (requests, scheduler outputs, block tables,
worker reports), then replayed into a fresh instance of each implementation over the same
stand-in block pool. Store lookups are answered from the recording in both (Mooncake's go to a
worker over ZMQ, Tailproof's to the store client), so only scheduler-side work is timed:
lookups' bookkeeping, load specs, trackers, hand-off claims, tail puts, job ids, pins.

Run: ``pytest benchmarks/test_scheduler_cost.py --benchmark-only`` (figures in
section 3 of ``BENCHMARKS.md``).
"""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "impl"))

GROUPS = (("full_attention", 16), ("mamba", 64))
H = 16


# --------------------------------------------------------------------------- recording


def _req(r: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=r.request_id, num_tokens=r.num_tokens, block_hashes=list(r.block_hashes),
        num_prompt_tokens=r.num_prompt_tokens, all_token_ids=list(r.all_token_ids),
        num_computed_tokens=r.num_computed_tokens, prompt_token_ids=list(r.prompt_token_ids))


def _so(so: Any) -> SimpleNamespace:
    from vllm.v1.core.sched.output import KVConnectorBlockState

    from tailproof.impl.vllm_release import resumed_as_cached

    st = so.kv_connector_block_state
    tables = {rid: tuple(list(g) for g in st.get_block_ids(rid)) for rid in st.req_ids}
    state = KVConnectorBlockState(
        req_ids=set(st.req_ids), resolve_block_ids=tables.__getitem__,
        boundary_state_offloads={k: list(v) for k, v in st.boundary_state_offloads.items()})
    c = so.scheduled_cached_reqs
    cached = SimpleNamespace(
        req_ids=list(c.req_ids),
        new_block_ids=[None if b is None else tuple(list(g) for g in b)
                       for b in c.new_block_ids],
        num_computed_tokens=list(c.num_computed_tokens))
    if resumed_as_cached():  # 0.33 only: 0.34 re-sends a resumed request as a new one
        cached.resumed_req_ids = set(c.resumed_req_ids)
    return SimpleNamespace(
        finished_req_ids=set(so.finished_req_ids),
        preempted_req_ids=set(so.preempted_req_ids or ()),
        scheduled_new_reqs=[SimpleNamespace(
            req_id=n.req_id, block_ids=tuple(list(g) for g in n.block_ids),
            num_computed_tokens=n.num_computed_tokens, prompt_token_ids=list(n.prompt_token_ids),
            prefill_token_ids=None if n.prefill_token_ids is None else list(n.prefill_token_ids))
            for n in so.scheduled_new_reqs],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(so.num_scheduled_tokens),
        kv_connector_block_state=state)


def record(num_convs: int = 32, turns: int = 4) -> tuple[list[tuple], int, Any]:
    """Run the workload on the real Scheduler; return (events, steps, geometry)."""
    from engine_sim import Engine

    e = Engine({"store": "memory", "namespace": "bench-record"}, num_blocks=1024, groups=GROUPS,
               h=H, max_batched=384)
    conn = e.conn
    events: list[tuple] = []
    real_jobs: list[list[int]] = []
    orig = {n: getattr(conn, n) for n in (
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "update_connector_output", "register_finished_partial_tail")}

    def matched(request: Any, n: int) -> Any:
        out = orig["get_num_new_matched_tokens"](request, n)
        spec = conn.scheduler_side.load_specs.get(request.request_id)
        hit = spec.kvpool_cached_tokens if spec is not None and out[0] else 0
        events.append(("match", _req(request), n, hit))
        return out

    def alloc(request: Any, blocks: Any, n: int) -> Any:
        ids = tuple(list(g) for g in blocks.get_block_ids())
        events.append(("alloc", _req(request), ids, n))
        return orig["update_state_after_alloc"](request, blocks, n)

    def build(so: Any) -> Any:
        events.append(("build", _so(so)))
        meta = orig["build_connector_meta"](so)
        real_jobs.append([j.store_job_id for j in meta.stores])
        return meta

    def output(out: Any) -> Any:
        wm = out.kv_connector_worker_meta
        events.append(("output", dict(wm.completed_saves) if wm else {},
                       set(out.failed_recving or ())))
        return orig["update_connector_output"](out)

    def tail(request: Any, block_ids: Any, offloads: Any) -> Any:
        events.append(("tail", _req(request), tuple(list(g) for g in block_ids), list(offloads)))
        return orig["register_finished_partial_tail"](request, block_ids, offloads)

    conn.get_num_new_matched_tokens = matched
    conn.update_state_after_alloc = alloc
    conn.build_connector_meta = build
    conn.update_connector_output = output
    conn.register_finished_partial_tail = tail

    system = list(range(1, 97))  # a shared 96-token system prompt
    history = {c: system + [500 + c * 13 + j for j in range(37 + c % 11)]
               for c in range(num_convs)}
    for t in range(turns):
        reqs = {c: e.add(f"c{c}t{t}", list(history[c]), max_tokens=8) for c in history}
        e.run(500)
        for c, r in reqs.items():
            history[c] = list(r.all_token_ids) + [700 + t * 31 + c + j for j in range(29)]
    steps = sum(1 for ev in events if ev[0] == "build")
    geom = conn.geo
    e.shutdown()
    record.real_jobs = real_jobs
    return events, steps, geom


# --------------------------------------------------------------------------- replay targets


class Pool:
    """The block pool surface both schedulers use (``blocks``, ``touch``, ``free_blocks``)."""

    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]

    def touch(self, blocks: list) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: Any) -> None:
        for b in blocks:
            b.ref_cnt -= 1


class _Blocks:
    def __init__(self, ids: tuple[list[int], ...]) -> None:
        self.ids = ids

    def get_block_ids(self, group_ids: Any = None) -> tuple[list[int], ...]:
        gs = range(len(self.ids)) if group_ids is None else group_ids
        return tuple(list(self.ids[g]) for g in gs)


def tailproof_target(geom: Any, pool: Pool) -> tuple[Any, Any]:
    from tailproof.impl.config import Settings
    from tailproof.impl.lookup import LookupResult
    from tailproof.impl.meta import TailproofWorkerMeta
    from tailproof.impl.scheduler_side import SchedulerSide

    hits: dict[str, int] = {}
    stub = SimpleNamespace(lookup=lambda n, h: LookupResult(hits.pop("next", 0),
                                                            (0,) * geom.num_groups))
    side = SchedulerSide(Settings(), geom, stub, 1)
    side.bind_gpu_block_pool(pool)

    def play(ev: tuple) -> None:
        kind = ev[0]
        if kind == "match":
            hits["next"] = ev[3]
            side.get_num_new_matched_tokens(ev[1], ev[2])
        elif kind == "alloc":
            side.update_state_after_alloc(ev[1], _Blocks(ev[2]), ev[3])
        elif kind == "build":
            side.build_connector_meta(ev[1])
        elif kind == "output":
            side.update_connector_output(TailproofWorkerMeta(completed_saves=dict(ev[1])), ev[2])
        else:
            side.register_finished_partial_tail(ev[1], ev[2], ev[3])

    return side, play


def mooncake_target(geom: Any, pool: Pool) -> tuple[Any, Any]:
    """``MooncakeStoreScheduler`` as its ``__init__`` builds it (MS:138-205), minus ZMQ."""
    from engine_sim import kv_cache_config
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeLookupResult,
        MooncakeStoreWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
        MooncakeStoreScheduler,
    )

    kvc = kv_cache_config(len(pool.blocks), GROUPS, H)
    coord = MooncakeStoreCoordinator(list(kvc.kv_cache_groups), geom.scheduler_block_size, H,
                                     enable_partial_hash_hits=geom.partial_hits)
    hits: dict[str, int] = {}
    s = object.__new__(MooncakeStoreScheduler)
    s.kv_role, s.load_async, s.lookup_async = "kv_both", True, False
    s.enable_lookup, s.save_decode_cache, s.enable_kv_events = True, False, False
    s.client = SimpleNamespace(
        lookup=lambda rid, n, hashes, non_block=False: MooncakeLookupResult(hits.pop("next", 0)),
        discard=lambda rid: None)
    s.kv_cache_config = kvc
    s._store_group_ids = kvc.prefix_cacheable_group_ids
    s._store_group_id_by_kv_cache_group_id = {g: i for i, g in enumerate(s._store_group_ids)}
    s._block_size, s._hash_block_size = geom.scheduler_block_size, H
    s._boundary_state_group_ids = frozenset(geom.mamba_group_ids)
    s._capacity_only = False
    s._store_coord = coord
    s.enable_partial_hash_hits = coord.enable_partial_hash_hits
    s._gpu_block_pool = pool
    s._num_workers = 1
    s._next_store_job_id = 0
    s._pinned_saves = {}
    s.load_specs, s._request_trackers, s._unfinished_requests = {}, {}, {}
    s._unfinished_request_ids, s._finished_partial_tail_metas = set(), {}
    s._finished_lookahead_metas = {}  # 0.34 (MooncakeStoreScheduler.__init__); unused by 0.33

    def play(ev: tuple) -> None:
        kind = ev[0]
        if kind == "match":
            hits["next"] = ev[3]
            s.get_num_new_matched_tokens(ev[1], ev[2])
        elif kind == "alloc":
            s.update_state_after_alloc(ev[1], _Blocks(ev[2]), ev[3])
        elif kind == "build":
            s.build_connector_meta(ev[1])
        elif kind == "output":
            s.update_connector_output(SimpleNamespace(
                kv_connector_worker_meta=MooncakeStoreWorkerMetadata(dict(ev[1]))))
        else:
            s.register_finished_partial_tail(ev[1], ev[2], ev[3])

    return s, play


TARGETS = {"tailproof": tailproof_target, "mooncake": mooncake_target}


WORKLOADS = {"32conv-4turn": (32, 4), "96conv-3turn": (96, 3)}


@pytest.fixture(scope="module", params=list(WORKLOADS))
def trace(request: pytest.FixtureRequest) -> tuple[list[tuple], int, Any]:
    return record(*WORKLOADS[request.param])


def _prepare(name: str, events: list[tuple], geom: Any) -> tuple[Pool, Any, Any, list]:
    """A fresh pool and scheduler, and a private copy of the events (not timed)."""
    pool = Pool(1024)
    target, play = TARGETS[name](geom, pool)
    return pool, target, play, copy.deepcopy(events)


def _play_all(play: Any, events: list[tuple]) -> None:
    """The timed part: every recorded scheduler -> connector call, in order."""
    for ev in events:
        play(ev)


@pytest.mark.parametrize("name", ["tailproof", "mooncake"])
def test_replay_is_equivalent(trace: tuple, name: str) -> None:
    """Both replays finish with every pin released (job ids line up with the reports)."""
    events, steps, geom = trace
    pool, target, play, evs = _prepare(name, events, geom)
    _play_all(play, evs)
    assert steps > 50
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    pinned = target.held if name == "tailproof" else target._pinned_saves
    assert pinned == {}


@pytest.mark.parametrize("name", ["tailproof", "mooncake"])
def test_scheduler_step_cost(benchmark: Any, trace: tuple, name: str) -> None:
    events, steps, geom = trace
    benchmark.group = f"connector scheduler side: {steps} steps, {len(events)} calls"
    benchmark.extra_info["calls"] = len(events)
    benchmark.extra_info["steps"] = steps

    def setup() -> tuple[tuple, dict]:
        _, _, play, evs = _prepare(name, events, geom)
        gc.collect()  # the deep copy's garbage must not be collected inside the timed replay
        return (play, evs), {}

    benchmark.pedantic(_play_all, setup=setup, rounds=40, warmup_rounds=3)
