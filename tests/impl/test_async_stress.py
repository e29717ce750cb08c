"""The asynchronous data plane under real concurrency, over vLLM 0.33's real ``Scheduler``.

Two workers, two sender and two receiver threads each, a block pool small enough to preempt,
and a store that answers after random delays (so calls finish out of order) and fails scripted
keys. After every engine step the invariants the data plane must keep are checked:

* no load served before it completed -- a request is never scheduled while its load is
  pending, and every finished load is checked byte for byte (``engine_sim``);
* no pin released before its put finished on every rank -- a store job whose pins the
  scheduler dropped is queued or running on no worker and was reported by every worker;
* no block reused while a job still reads it -- every queued or running job is still pinned
  and its blocks still referenced; every value is checked byte for byte as it is written;
* nothing leaks -- at the end no pin, no block reference, no queued job, no store lease.

Outcomes do not depend on timing: every request produces the same tokens under every delay
seed and without a connector; every load of a key scripted to fail fails closed.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

from tailproof.impl.stores import MemoryStore, Outcome, Store  # noqa: E402

pytestmark = pytest.mark.vllm

FAIL_PUT_MOD, FAIL_GET_MOD = 11, 13  # crc32(key) % MOD == 0: the store fails that key


def _fails(key: str, mod: int) -> bool:
    return zlib.crc32(key.encode()) % mod == 0


class DelayStore(Store):
    """A memory store behind random per-call delays (seeded) and per-key scripted failures.

    Failures depend on the key only (puts answer STORE_FULL, gets TIMEOUT), so which loads fail
    does not depend on timing; the delays make concurrent calls finish out of order. Every
    value written is handed to ``check`` (the bytes its key must hold)."""

    name = "delay"

    def __init__(self, seed: int, max_delay_s: float = 0.004) -> None:
        self.inner = MemoryStore(1 << 26)
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self._lock = threading.Lock()
        self.check: Any = None  # (key, value bytes) -> None
        self.in_flight = 0

    def _delay(self) -> None:
        with self._lock:
            d = self.rng.uniform(0, self.max_delay_s)
        time.sleep(d)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._delay()
        return self.inner.exists(keys)

    def put_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        raise AssertionError("the connector writes through write_batch")

    def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        raise AssertionError("the connector reads through read_batch")

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Any,
                    staging: Any = None) -> list[Outcome]:
        with self._lock:
            self.in_flight += 1
        try:
            self._delay()
            go = [i for i, k in enumerate(keys) if not _fails(k, FAIL_PUT_MOD)]

            def checked(j: int, out: np.ndarray) -> None:
                produce(go[j], out)
                self._delay()  # the value is half-written while others run
                if self.check is not None:
                    self.check(keys[go[j]], out)

            real = self.inner.write_batch([keys[i] for i in go], [sizes[i] for i in go],
                                          checked)
            outs = [Outcome.full()] * len(keys)
            for i, o in zip(go, real, strict=True):
                outs[i] = o
            return outs
        finally:
            with self._lock:
                self.in_flight -= 1

    def read_batch(self, keys: Sequence[str], sizes: Sequence[int], consume: Any,
                   staging: Any = None) -> list[Outcome]:
        self._delay()
        if any(_fails(k, FAIL_GET_MOD) for k in keys):
            return [Outcome.timeout() if _fails(k, FAIL_GET_MOD) else Outcome.error()
                    for k in keys]
        return self.inner.read_batch(keys, sizes, consume)

    def remove(self, keys: Sequence[str]) -> int:
        return self.inner.remove(keys)

    def remove_all(self) -> int:
        return self.inner.remove_all()

    def close(self) -> None:
        self.inner.close()


def _prompts(n: int) -> list[list[int]]:
    """Conversations that share prefixes (hits, sub-block tails) and differ after them."""
    rng = random.Random(7)
    base = [rng.randrange(10, 900) for _ in range(70)]
    out = []
    for i in range(n):
        cut = rng.choice([20, 33, 45, 64, 70])
        out.append(base[:cut] + [900 + i] * rng.randrange(3, 40))
    return out


class Invariants:
    """The per-step checks of the module docstring, plus the put byte check."""

    def __init__(self, e: Engine, store: DelayStore | None = None) -> None:
        self.e = e
        self.store = store
        self.reported: list[set[int]] = [set() for _ in e.workers]
        self.errors: list[str] = []
        self._hashes: dict[str, tuple[list[int], int, str]] = {}
        for w, (wc, _) in enumerate(e.workers):
            ws = wc.worker_side
            orig = ws._report

            def report(job: Any, _orig: Any = orig, _w: int = w) -> None:
                self.reported[_w].add(job.store_job_id)  # first: the put is over, the pins not yet
                _orig(job)

            ws._report = report
            finish = ws._finish_load

            def finish_load(job: Any, ok: bool, _orig: Any = finish, _w: int = w) -> None:
                self.loads.append((_w, job, ok))
                _orig(job, ok)

            ws._finish_load = finish_load
        self.loads: list[tuple[int, Any, bool]] = []
        if store is not None:
            store.check = self.check_value

    def learn(self, req: Any) -> None:
        """Remember which prefix each of a request's block hashes names (for put checks)."""
        h = self.e.h
        for i, bh in enumerate(req.block_hashes):
            self._hashes.setdefault(bytes(bh).hex(), (list(req.all_token_ids), (i + 1) * h,
                                                      req.request_id))

    def check_value(self, key: str, value: np.ndarray) -> None:
        import torch

        from tailproof.impl.keys import parse_key
        from tailproof.impl.value_format import HEADER_BYTES

        parsed = parse_key(key)
        tp_size = self.e.workers[0][0].worker_side.keys.tp_size
        r = parsed.pp_rank * tp_size + parsed.tp_rank  # KeySpace.key's rank split, inverted
        g, hexhash = parsed.group, parsed.block_hash.hex()
        if hexhash not in self._hashes:  # a block hashed this very step (another thread)
            for req in list(self.e.sched.requests.values()):
                self.learn(req)
        if hexhash not in self._hashes:
            self.errors.append(f"put {key}: no request has this prefix hash")
            return
        tokens, boundary, rid = self._hashes[hexhash]
        runner = self.e.workers[r][1]
        bad = runner.check_block_bytes(g, torch.from_numpy(value[HEADER_BYTES:].copy()), tokens,
                                       boundary, rid)
        self.errors += [f"put {key}: {b}" for b in bad]

    def after_step(self, pinned_before: set[int]) -> None:
        side = self.e.conn.scheduler_side
        pool = self.e.sched.kv_cache_manager.block_pool
        released = pinned_before - set(side.held)
        for w, (wc, _) in enumerate(self.e.workers):
            ws = wc.worker_side
            running = {lane.running.store_job_id for lane in ws.senders._lanes
                       if lane.running is not None} - self.reported[w]
            live = {j.store_job_id for j in ws.queue} | running
            early = released & live
            assert not early, f"pins of jobs {early} released while worker {w} still runs them"
            missing = released - self.reported[w]
            assert not missing, f"pins of jobs {missing} released before worker {w} reported"
            for jid in live:
                assert jid in side.held, f"job {jid} runs on worker {w} but is not pinned"
                ids, _ = side.held[jid]
                assert all(pool.blocks[b].ref_cnt >= 1 for b in ids), (
                    f"a block of running job {jid} lost its reference")
        assert not self.errors, self.errors[:3]


def _serve(e: Engine, inv: Invariants, prompts: list[list[int]], rng: random.Random,
           tag: str, max_tokens: int) -> list[Any]:
    """Serve ``prompts`` (arriving at random steps), checking the invariants after every step;
    wait until every background job finished and every pin is gone."""
    reqs: list[Any] = []
    pending = list(enumerate(prompts))
    steps = 0
    while pending or e.sched.has_requests() or e.conn.has_pending_push_work():
        while pending and rng.random() < 0.6:  # arrivals interleave with steps
            i, p = pending.pop(0)
            reqs.append(e.add(f"{tag}{i}", p, max_tokens=max_tokens))
            inv.learn(reqs[-1])
        before = set(e.conn.scheduler_side.held)
        log = e.step()
        for r in reqs:
            inv.learn(r)
        inv.after_step(before)
        if not log.scheduled:
            e.wait_workers(0.01)
        steps += 1
        assert steps < 3000, "engine did not drain"
    assert e.wait_workers(10.0)
    return reqs


def _engine(cfg: dict[str, Any], store: DelayStore) -> tuple[Engine, Invariants]:
    e = Engine(cfg, num_blocks=24, num_workers=2, settle=False)
    return e, Invariants(e, store)


def _run(seed: int, n_requests: int = 8) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Two engines sharing one delay store: the first saves, the second (longer prompts with
    the same prefixes) loads; both preempt. Returns (outputs per request, outcome counts)."""
    import json

    from tailproof.impl import connector
    from tailproof.impl.config import parse_settings

    store = DelayStore(seed)
    # A fixed namespace: the keys (and so which of them the store fails) depend only on the
    # seed, so every run meets the same scripted failures and the same loads.
    cfg = {"store": "memory", "namespace": f"stress-{seed}",
           "capacity_bytes": 1 << 26, "send_threads": 2, "recv_threads": 2}
    # The engine's roles acquire their store through the shared-store table: plant ours there.
    table_key = json.dumps(parse_settings(cfg, "kv_both").store_config, sort_keys=True)
    connector._SHARED[table_key] = [store, 1]  # held by this test until the end
    t_start = time.perf_counter()
    rng = random.Random(seed)
    prompts = _prompts(n_requests)
    counts = {"finished": 0, "output_tokens": 0, "preemptions": 0, "loads": 0,
              "failed_loads": 0}
    outputs: dict[str, list[int]] = {}
    for tag, ps in [("p", prompts), ("c", [p + [5] * 9 for p in prompts])]:
        e, inv = _engine(cfg, store)
        reqs = _serve(e, inv, ps, rng, tag, max_tokens=12)
        for w, job, ok in inv.loads:  # a load fails exactly when a key of it is scripted to
            ws = e.workers[w][0].worker_side
            keys = [ws.key(g, hh) for g, _, hh in ws.load_plan(job)]
            assert ok == (not any(_fails(k, FAIL_GET_MOD) for k in keys)), (job.req_id, ok)
        assert [x for log in e.log for x in log.byte_errors] == []
        assert e.conn.scheduler_side.held == {}
        assert e.refcounts() == {}
        for wc, _ in e.workers:
            assert wc.worker_side.queue == [] and wc.worker_side.stored_requests == {}
        outputs.update({r.request_id: list(r.output_token_ids) for r in reqs})
        counts["finished"] += sum(r.is_finished() for r in reqs)
        counts["output_tokens"] += sum(r.num_output_tokens for r in reqs)
        counts["preemptions"] += sum(r.num_preemptions for r in reqs)
        counts["loads"] += len(inv.loads)
        counts["failed_loads"] += sum(not ok for _, _, ok in inv.loads)
        e.shutdown()
    assert store.in_flight == 0 and store.inner._leases == {} and store.inner._filling == {}
    counts["seconds"] = round(time.perf_counter() - t_start, 2)
    print("stress", seed, counts)
    connector._SHARED.pop(table_key, None)
    return outputs, counts


@pytest.mark.parametrize("seeds", [(1, 2, 3)])
def test_stress_random_delays_failures_preemption(seeds: tuple[int, ...]) -> None:
    results = [_run(s) for s in seeds]
    outputs = [o for o, _ in results]
    assert all(o == outputs[0] for o in outputs[1:])  # timing never changes what is computed
    for _, counts in results:
        assert counts["finished"] == 16 and counts["output_tokens"] == 16 * 12
    assert any(c["preemptions"] for _, c in results)  # the pool was small enough to preempt
    assert any(c["loads"] for _, c in results)
    assert any(c["failed_loads"] for _, c in results)  # scripted get failures were met
