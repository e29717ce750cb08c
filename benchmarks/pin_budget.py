"""Free blocks of a small pool with slow background senders: vLLM 0.33's real ``Scheduler``
without a connector, against ``TailproofConnector`` (producer, memory store) whose senders
fall behind, without and with the pin budget (``pin_budget_fraction``).

Workload (seeded): 24 requests, 30-80-token prompts, 6 output tokens each, one arriving per
step, on a 48-block pool (full attention 16 + Mamba 16, h 4). A slow sender: every store
put waits on a gate that opens only every ``--period`` steps (then every queued job runs and
reports, and the gate closes again), so store jobs hold their pins for up to that many steps
and a finished request's blocks stay pinned. Per step, after ``schedule()``: the pool's free
blocks. Prints, per variant, the minimum and mean free blocks, engine steps, preemptions,
jobs skipped by the budget, and whether every request finished in the same step as without
a connector. Counts only (no timing); the load is printed for the record.

    .venv/bin/python benchmarks/pin_budget.py [--period 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "impl"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_BLOCKS, H, MAX_TOKENS = 48, 4, 6


def workload(seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 900) for _ in range(rnd.randrange(30, 81))] for _ in range(24)]


class Gate:
    """Holds every store put until :meth:`drain` opens it (the slow sender)."""

    def __init__(self, store: Any) -> None:
        self.open = threading.Event()
        inner = store.write_batch

        def write_batch(*a: Any, **k: Any) -> Any:
            assert self.open.wait(60.0), "the gate never opened"
            return inner(*a, **k)

        store.write_batch = write_batch


def run(variant: str, prompts: list[list[int]], period: int) -> dict[str, Any]:
    """One run: per-step free blocks, steps, preemptions, skipped jobs, finish steps."""
    from engine_sim import Engine

    extra: dict[str, Any] = {"store": "memory", "namespace": f"pb-{random.random()}",
                             "readable_pins": True}
    extra["pin_budget_fraction"] = 0.25 if variant == "budget 0.25" else None
    e = Engine(extra, num_blocks=NUM_BLOCKS, settle=False)
    if variant == "none":  # vLLM's Scheduler with no connector at all
        e.sched.connector = None
    gate = Gate(e.workers[0][0].worker_side.store)
    pool = e.sched.kv_cache_manager.block_pool
    free: list[int] = []
    finish: dict[str, int] = {}
    preempted = 0
    step = 0
    try:
        while len(finish) < len(prompts) and step < 400:
            if step < len(prompts):
                e.add(f"r{step}", prompts[step], max_tokens=MAX_TOKENS)
            if variant != "none" and step % period == period - 1:
                gate.open.set()  # the sender catches up: every queued job runs
                assert e.wait_workers(60.0)
                gate.open.clear()
            if variant == "none":
                log = _step_without_connector(e)
            else:
                log = e.step()
            free.append(pool.get_num_free_blocks())
            preempted += len(getattr(log, "preempted", ()) or ())
            for rid in log.finished:
                finish.setdefault(rid, step)
            step += 1
    finally:
        gate.open.set()
        if variant != "none":
            e.wait_workers(60.0)
        e.ranks.shutdown()
        e.conn.shutdown()
    side = e.conn.scheduler_side
    skipped = side.metrics.c.total("jobs_skipped_pin_budget") if variant != "none" else 0
    return {"free": free, "steps": step, "finish": finish, "preempted": preempted,
            "skipped": skipped}


def _step_without_connector(e: Any) -> Any:
    """One step of the connector-less scheduler: its model runner output samples a token for
    every request whose prefill is done (as ``WorkerRanks`` does, without workers)."""
    from types import SimpleNamespace

    from tailproof.conformance.vllm_release import model_runner_output

    so = e.sched.schedule()
    rids = list(so.num_scheduled_tokens)
    reqs = e.sched.requests
    sampled = [[e.next_token(reqs[r])] if reqs[r].num_computed_tokens >= reqs[r].num_tokens
               else [] for r in rids]
    mro = model_runner_output(rids, sampled_token_ids=sampled)
    eco = e.sched.update_from_output(so, mro)
    done = [x.request_id for o in eco.values() for x in o.outputs if x.finish_reason is not None]
    return SimpleNamespace(finished=done, preempted=list(so.preempted_req_ids or ()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--period", type=int, default=4, help="steps between sender catch-ups")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"load before: {os.getloadavg()}", flush=True)
    prompts = workload(args.seed)
    base = None
    for variant in ("none", "no budget", "budget 0.25"):
        r = run(variant, prompts, args.period)
        base = base or r
        same = r["finish"] == base["finish"]
        print(f"{variant:>12}: min free {min(r['free']):>2}, mean free "
              f"{sum(r['free']) / len(r['free']):5.1f}, steps {r['steps']}, preempted "
              f"{r['preempted']}, skipped by budget {r['skipped']}, finish steps same as "
              f"none: {same}", flush=True)
    print(f"load after: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
