"""Microseconds per scheduler step inside each of ``TailproofConnector``'s scheduler hooks, on
the workload of ``waiting_lookups.py`` (vLLM's real ``Scheduler``, no forward): a running
request R prefills 2,048 tokens a step while N L-token prompts wait.

BENCHMARKS.md §12's per-hook tables: ``perf_counter`` around ``build_connector_meta``,
``get_num_new_matched_tokens``, ``update_connector_output`` and ``get_kv_connector_stats``
(the connector's own methods, wrapped on the instance), summed over R's full-chunk steps and
divided by the steps; each run builds a fresh scheduler. Prints the median over the runs, then
the min, per hook.

    .venv/bin/python benchmarks/hook_costs.py [--runs 30] [--length 32768] [--waiting 16]
        [--json FILE]

The tree measured is the one ``tailproof`` imports from: run it from two checkouts, alternating,
to pair a before with an after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

HOOKS = ("build_connector_meta", "get_num_new_matched_tokens", "update_connector_output",
         "get_kv_connector_stats")


def timed(fn: Callable[..., Any], acc: dict[str, float], name: str) -> Callable[..., Any]:
    """``fn`` with its wall time added to ``acc[name]`` on every call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    return wrapper


def one_run(length: int, waiting: int, running: int) -> tuple[dict[str, float], float]:
    """Per hook, seconds per step over one run of R's prefill; and the whole step."""
    import waiting_lookups as wl

    acc = dict.fromkeys(HOOKS, 0.0)
    build = wl.build

    def instrumented(variant: str, max_len: int, num_blocks: int) -> Any:
        sched = build(variant, max_len, num_blocks)
        conn = sched.connector
        for name in HOOKS:
            setattr(conn, name, timed(getattr(conn, name), acc, name))
        return sched

    wl.build = instrumented
    try:
        total, steps, _ = wl.run("connector", length, waiting, running)
    finally:
        wl.build = build
    return {k: v / steps for k, v in acc.items()}, total / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--waiting", type=int, default=16)
    ap.add_argument("--running", type=int, default=16384)
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = ap.parse_args(argv)
    from run_info import RunInfo
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    import tailproof.impl

    init_none_hash(sha256)
    tree = str(Path(tailproof.impl.__file__).parents[1])
    print(f"tree: {tree}", flush=True)
    info = RunInfo.start()
    one_run(args.length, args.waiting, args.running)  # warm-up, untimed
    per: dict[str, list[float]] = {k: [] for k in HOOKS}
    steps: list[float] = []
    for _ in range(args.runs):
        hooks, step = one_run(args.length, args.waiting, args.running)
        for k, v in hooks.items():
            per[k].append(v)
        steps.append(step)
    cells = [f"{k} {1e6 * statistics.median(v):.1f} (min {1e6 * min(v):.1f})"
             for k, v in per.items()]
    cells.append(f"whole step {1e6 * statistics.median(steps):.0f}")
    print(" | ".join(cells) + " us/step", flush=True)
    info.finish({"benchmark": "hook_costs", "tree": tree, "runs": args.runs,
                 "length": args.length, "waiting": args.waiting, "running": args.running,
                 "us_per_step": {k: [round(1e6 * statistics.median(v), 1),
                                     round(1e6 * min(v), 1)] for k, v in per.items()},
                 "whole_step_us_median": round(1e6 * statistics.median(steps)),
                 "figures": "[median, min] over the runs"}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
