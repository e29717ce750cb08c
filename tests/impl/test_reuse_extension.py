"""The turn-end checkpoint extension (docs/reuse.md) under vLLM 0.33's real Scheduler on CPU.

A 2-turn conversation: turn 1 runs on a producer with the extension on; turn 2 (turn 1's prompt
+ response + new text) runs on a fresh engine and must resume at turn 1's last computed hash
boundary, every loaded byte checked by ``engine_sim``. With the extension off the hit stays at
the prompt's own checkpoint ck(P).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))  # 45 tokens: ck(45) = 44 with h=4
EXT = {"turn_end_checkpoints": True, "decode_boundary_saves": True}


@pytest.fixture
def store_ns(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    yield {"store": "memory", "namespace": f"t-{request.node.name}"[:60].replace("@", "_"),
           "capacity_bytes": 1 << 26}


def _turn1(cfg: dict[str, Any], max_tokens: int, workers: int = 1) -> tuple[Engine, list[int]]:
    e = Engine(cfg, num_workers=workers)
    req = e.add("t1", list(A), max_tokens=max_tokens)
    e.run(200)
    assert [x for log in e.log for x in log.byte_errors] == []
    assert e.conn.scheduler_side.held == {}
    assert e.refcounts() == {}  # snapshot blocks and pins all released
    assert e.conn.scheduler_side.ext.snapshot_slots() == {}
    return e, list(req.all_token_ids)


def _turn2(cfg: dict[str, Any], tokens: list[int], workers: int = 1) -> list[tuple[int, int]]:
    e = Engine(cfg, num_workers=workers)
    e.add("t2", tokens + [7] * 10, max_tokens=1)
    logs = e.run(200)
    assert [x for log in e.log for x in log.byte_errors] == []
    loads = [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for log in logs for j in log.loads]
    e.shutdown()
    return loads


@pytest.mark.parametrize(("max_tokens", "last"), [(20, 64), (22, 64), (16, 60), (17, 60)])
def test_second_turn_resumes_at_first_turns_last_boundary(store_ns: dict, max_tokens: int,
                                                         last: int) -> None:
    """Turn 1: 45 prompt + ``max_tokens`` outputs (one fewer computed): turn 2 loads
    [0, last) byte-exact, ``last`` the last hash boundary turn 1 computed."""
    e1, tokens = _turn1({**store_ns, **EXT}, max_tokens)
    side = e1.conn.scheduler_side
    assert side.metrics.c.total("snapshots_taken") == len(range(48, last + 1, 4))  # past ck=44
    assert side.metrics.c.total("turn_end_jobs") == 1
    copies = sum(s.get("snapshot_copy_bytes", 0) for log in e1.log for s in log.worker_stats)
    assert copies > 0
    assert _turn2({**store_ns, **EXT}, tokens) == [(0, last)]
    e1.shutdown()  # the last user closes the (process-shared) memory store


def test_two_workers_each_copy_and_flush_their_shard(store_ns: dict) -> None:
    """Two ranks: each copies its own shard's snapshot and puts it; the flush's pins go only
    after both reported; turn 2 (two ranks) loads [0, 60) byte-exact from both shards."""
    e1, tokens = _turn1({**store_ns, **EXT}, 16, workers=2)
    copies = [s.get("snapshot_copies", 0) for log in e1.log for s in log.worker_stats]
    assert sum(copies) == 2 * len(range(48, 60 + 1, 4))
    assert _turn2(dict(store_ns), tokens, workers=2) == [(0, 60)]
    e1.shutdown()


@pytest.mark.parametrize(("ext", "hit"), [
    ({"turn_end_checkpoints": True}, 60),  # the snapshot at 60
    ({"decode_boundary_saves": True}, 48),  # the decode-time Mamba block boundary (B=16)
])
def test_each_half_of_the_extension_alone(store_ns: dict, ext: dict, hit: int) -> None:
    """Turn 1 computes 60 tokens: turn-end checkpoints alone store 60; decode boundary saves
    alone store the last aligned Mamba state, 48."""
    e1, tokens = _turn1({**store_ns, **ext}, 16)
    assert _turn2(dict(store_ns), tokens) == [(0, hit)]
    e1.shutdown()


def test_decode_boundaries_are_vllms_own_where_it_has_them(store_ns: dict) -> None:
    """vLLM 0.34 stores decode-time Mamba states itself (``save_decode_cache``;
    ``vllm_release.decode_checkpoints``): ``decode_boundary_saves`` is served by that
    mechanism, rule 5's own attention puts off; 0.33 has none: rule 5 as written. Either way
    turn 2 resumes at the decode-time boundary 48, every loaded byte checked."""
    from tailproof.impl.vllm_release import decode_checkpoints

    e1, tokens = _turn1({**store_ns, "decode_boundary_saves": True}, 16)
    native = decode_checkpoints()
    s = e1.conn.settings
    assert (s.save_decode_cache, s.native_decode_boundaries) == (native, native)
    assert _turn2(dict(store_ns), tokens) == [(0, 48)]
    e1.shutdown()


def test_extension_off_hit_stays_at_prompt_checkpoint(store_ns: dict) -> None:
    e1, tokens = _turn1(dict(store_ns), 20)
    assert e1.conn.scheduler_side.metrics.c.total("snapshots_taken") == 0
    assert _turn2(dict(store_ns), tokens) == [(0, 44)]
    e1.shutdown()


def _abort_at(e: Engine, req: Any, computed: int) -> None:
    """Decode ``req`` until it computed ``computed`` tokens, then end it the way an EOS or a
    stop string would (not by length, so rule 3b cannot flush it early): an abort, which
    vLLM frees through the same ``_connector_finished`` path."""
    from vllm.v1.request import RequestStatus

    while req.num_computed_tokens < computed:
        e.step()
    assert req.num_computed_tokens == computed
    e.sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)


def test_next_turn_sent_at_finish_waits_for_the_flush(store_ns: dict) -> None:
    """Rule 7: turn 1 ends early (not by length) having computed 62, and turn 2 is added at
    once, before the finish-time flush job was even emitted; its lookup is deferred until the
    flush landed, then it loads [48, 60): the device cache holds the aligned Mamba state at 48,
    the store the turn-end one at 60."""
    e = Engine({**store_ns, **EXT})
    req = e.add("t1", list(A), max_tokens=40)
    _abort_at(e, req, 62)
    e.add("t2", list(req.all_token_ids[:62]) + [7] * 10, max_tokens=1)
    logs = e.run(200)
    assert [x for log in e.log for x in log.byte_errors] == []
    loads = [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for log in logs for j in log.loads]
    assert loads == [(48, 60)]
    assert e.conn.scheduler_side.metrics.c.total("lookups_deferred") >= 1
    assert e.conn.scheduler_side.held == {} and e.refcounts() == {}
    e.shutdown()


def test_next_turn_without_lookup_wait_resumes_at_checkpoint(store_ns: dict) -> None:
    """The same without the wait: the lookup runs before the flush landed (the race rule 7
    closes), so turn 2 resumes at the device's aligned Mamba state, 48."""
    e = Engine({**store_ns, **EXT, "checkpoint_lookup_wait": False})
    req = e.add("t1", list(A), max_tokens=40)
    _abort_at(e, req, 62)
    t2 = e.add("t2", list(req.all_token_ids[:62]) + [7] * 10, max_tokens=1)
    logs = e.run(200)
    assert [x for log in e.log for x in log.byte_errors] == []
    loads = [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for log in logs for j in log.loads]
    assert e.conn.scheduler_side.metrics.c.total("lookups_deferred") == 0
    assert loads == []
    computed = sum(log.scheduled.get("t2", 0) for log in logs)  # max_tokens=1: prefill only
    assert computed == t2.num_prompt_tokens - 48
    e.shutdown()


@pytest.mark.parametrize("wait", [True, False])
def test_finish_by_length_is_flushed_before_it_ends(store_ns: dict, wait: bool) -> None:
    """Rule 3b: a turn ending by length (max_tokens 16: 60 computed, its last boundary known in
    advance) is flushed at that boundary, before it finishes; a next turn added at once loads
    [48, 60) with no deferral, with or without the lookup wait."""
    e = Engine({**store_ns, **EXT, "checkpoint_lookup_wait": wait})
    req = e.add("t1", list(A), max_tokens=16)
    while not any("t1" in log.finished for log in e.log[-1:]):
        e.step()
    e.add("t2", list(req.all_token_ids) + [7] * 10, max_tokens=1)
    logs = e.run(200)
    assert [x for log in e.log for x in log.byte_errors] == []
    loads = [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for log in logs for j in log.loads]
    assert loads == [(48, 60)]
    assert e.conn.scheduler_side.metrics.c.total("lookups_deferred") == 0
    assert e.conn.scheduler_side.held == {} and e.refcounts() == {}
    e.shutdown()
