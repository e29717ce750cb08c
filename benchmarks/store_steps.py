"""Engine steps on the store path vs the device cache alone, with each request's timeline.

The ``agent`` workload of ``reuse_hit_rate.py`` (16 conversations sharing a 4,000-token system
prompt, 3 turns each, 64-token responses, 100-400-token tool results) on vLLM 0.33's real
``Scheduler`` on CPU, Mamba block 1,024, h 16, attention blocks ``--fa-block`` (16 and 1,024),
a device pool of ``--blocks`` blocks. Variants: ``device`` (no connector), ``connector``
(``TailproofConnector``, memory store, workers simulated with byte checks of every load) and
``extension`` (every reuse-extension part ``"auto"``); each store variant with
``divergent_local_hits`` off and on (``--divergent``). Every load is checked byte for byte over
the request's whole prefix ``[0, hit)``, the attention blocks it shares locally included.

Per request, in engine steps (``schedule`` calls): arrival, first schedule (its load step for
an asynchronous load, else its first compute), load start (the step whose connector metadata
carries the load), load finish (the step whose connector output reports it), first compute,
finish; and its hit at admission (device + store). Summaries: mean steps arrival -> first
compute and load start -> first compute, the mean number of requests computing per step, the
tokens the loads wrote into fresh blocks of the pool (no other request shares those blocks
until the load ends) and the loads of requests re-admitted after a preemption.
The figures are counts, deterministic per seed.

    .venv/bin/python benchmarks/store_steps.py [--fa-block 16 1024] [--timeline]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import junction_reuse  # noqa: E402  (sets the vLLM environment defaults)
import reuse_hit_rate as rhr  # noqa: E402

VARIANTS = ("device", "connector", "extension")
EVENTS = ("arrive", "first", "load", "loaded", "compute", "finish", "hit")


@dataclass
class Run:
    """One variant's counts and per-request timelines (step numbers)."""

    fa_block: int
    variant: str
    result: Any
    timeline: dict[str, dict[str, int]] = field(default_factory=dict)
    computing: list[int] = field(default_factory=list)  # requests computing, per step
    loaded_tokens: int = 0
    reloads: int = 0  # loads of requests re-admitted after a preemption (not in the timeline)

    def mean(self, a: str, b: str) -> float:
        spans = [t[b] - t[a] for t in self.timeline.values() if a in t and b in t]
        return sum(spans) / len(spans) if spans else 0.0


class Device(rhr.DeviceOnly):
    """The device cache alone, attention blocks ``fa_block``."""

    def __init__(self, num_blocks: int, max_batched: int, fa_block: int):
        from engine_sim import Engine

        self.sched = junction_reuse.make_scheduler(False, False, num_blocks, max_batched,
                                                   fa_block)
        self.next_token = Engine.next_token


class Store(rhr.WithConnector):
    """``TailproofConnector`` on the memory store, attention blocks ``fa_block``."""

    def __init__(self, num_blocks: int, max_batched: int, fa_block: int, namespace: str,
                 extra: dict[str, Any]):
        from engine_sim import Engine

        self.copy_bytes = 0
        self.engine = Engine({"store": "memory", "namespace": namespace, **extra},
                             num_blocks=num_blocks,
                             groups=(("full_attention", fa_block), ("mamba", rhr.BLOCK)),
                             h=rhr.H, max_batched=max_batched, max_model_len=junction_reuse.MAX_LEN)
        self.sched = self.engine.sched
        self.engine.ranks._check_load = self._check_whole_prefix

    @staticmethod
    def _check_whole_prefix(sched: Any, runner: Any, job: Any, log: Any) -> None:
        """``WorkerRanks._check_load`` over ``[0, hit)``: the loaded blocks and the local ones
        the request adopted (a divergent hit shares another request's attention blocks)."""
        tokens = sched.requests[job.req_id].all_token_ids
        log.byte_errors += runner.check(job.req_id, tokens, 0, job.kvpool_cached_tokens,
                                        job.block_ids)


def _instrument(engine: Any, driver: rhr.Driver, run: Run) -> None:
    """Record each request's events as the driver steps the engine."""
    tl = run.timeline
    add, step, sched = driver.add, engine.step, engine.sched
    update = sched.update_from_output

    def on_add(turn: rhr.Turn) -> None:
        add(turn)
        tl[next(reversed(driver.live))] = {"arrive": run.result.steps}

    def on_update(so: Any, mro: Any) -> Any:
        kvo = getattr(mro, "kv_connector_output", None)
        for rid in (kvo.finished_recving or ()) if kvo is not None else ():
            tl[rid].setdefault("loaded", run.result.steps)
        return update(so, mro)

    def on_step() -> Any:
        k = run.result.steps
        out = step()
        if hasattr(engine, "engine"):
            for job in engine.engine.log[-1].loads:
                run.loaded_tokens += job.kvpool_cached_tokens - job.vllm_cached_tokens
                if "compute" in tl[job.req_id]:
                    run.reloads += 1
                    continue
                tl[job.req_id].setdefault("load", k)
                tl[job.req_id].setdefault("first", k)
        for rid, n in out[0].items():
            tl[rid].setdefault("first", k)
            if "compute" not in tl[rid]:
                tl[rid]["compute"] = k
                tl[rid]["hit"] = sched.requests[rid].num_computed_tokens - n
        for rid in out[1]:
            tl[rid]["finish"] = k
        run.computing.append(len(out[0]))
        return out

    driver.add, engine.step, sched.update_from_output = on_add, on_step, on_update


def run_one(fa_block: int, variant: str, seed: int, blocks: int, sizes: rhr.Sizes,
            divergent: bool | str = False) -> Run:
    """The agent workload under one variant."""
    if variant == "device":
        engine: Any = Device(blocks, sizes.max_batched, fa_block)
    else:
        extra: dict[str, Any] = {k: "auto" for k in rhr.EXTENSION} if variant == "extension" else {}
        extra["divergent_local_hits"] = divergent
        engine = Store(blocks, sizes.max_batched, fa_block, f"steps-{fa_block}-{seed}", extra)
    run = Run(fa_block, variant, rhr.Result("agent", variant))
    driver = rhr.Driver(engine, run.result)
    _instrument(engine, driver, run)
    try:
        rhr.agent(driver, random.Random(f"agent:{seed}"), sizes)
    finally:
        engine.shutdown()
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fa-block", type=int, nargs="+", default=[16, 1024])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--blocks", type=int, default=rhr.LARGE_BLOCKS, help="device pool blocks")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--divergent", nargs="+", choices=("off", "on", "auto"),
                    default=["off", "on"], help="divergent_local_hits of the store variants")
    ap.add_argument("--timeline", action="store_true", help="print every request's events")
    args = ap.parse_args(argv)
    sizes = rhr.Sizes()
    print(f"load {os.getloadavg()[0]:.2f} (1 min); agent workload, Mamba block {rhr.BLOCK}, "
          f"h {rhr.H}, pool {args.blocks} blocks, max_num_batched_tokens {sizes.max_batched}")
    print("fa    seed variant    divergent  steps  x device  hit/oracle  preempt  "
          "arrive->compute  load->compute  computing/step  loaded tokens  reloads")
    for fa_block in args.fa_block:
        for seed in args.seeds:
            base = None
            runs = [(v, {"on": True, "off": False}.get(d, d)) for v in args.variants
                    for d in (("off",) if v == "device" else args.divergent)]
            for variant, divergent in runs:
                r = run_one(fa_block, variant, seed, args.blocks, sizes, divergent)
                base = base or r.result.steps
                per_step = sum(r.computing) / max(1, len(r.computing))
                div = ("-" if variant == "device" else divergent if isinstance(divergent, str)
                       else "on" if divergent else "off")
                print(f"{fa_block:<5} {seed:<4} {variant:<10} {div:<10} {r.result.steps:<6} "
                      f"{r.result.steps / base:<9.3f} {r.result.ratio:<11.3f} "
                      f"{r.result.preempted:<8} {r.mean('arrive', 'compute'):<16.1f} "
                      f"{r.mean('load', 'compute'):<14.2f} {per_step:<15.2f} "
                      f"{r.loaded_tokens:<14} {r.reloads}", flush=True)
                if args.timeline:
                    print("  request " + " ".join(f"{e:>7}" for e in EVENTS))
                    for rid, t in r.timeline.items():
                        print(f"  {rid:<7} " + " ".join(f"{t.get(e, '-'):>7}" for e in EVENTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
