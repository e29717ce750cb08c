"""Connector scheduler side ÷ the installed vLLM's ``MooncakeStoreScheduler``, paired rounds.

The traces and both targets are ``benchmarks/test_scheduler_cost.py``'s (recorded once from
vLLM's real ``Scheduler`` driving ``TailproofConnector``; every scheduler -> connector call
replayed into a fresh instance of each; lookups answered from the recording in both). Each
round replays the trace on both, in an order that alternates per round; a round's ratio is
Tailproof's time over Mooncake's. Prints min and median of the paired ratios, the function
calls of one replay of each (``cProfile``), the vLLM release and the machine load
(``run_info``: one ``--json`` line on stdout, also written to ``--json FILE``).

    .venv/bin/python benchmarks/scheduler_vs_mooncake.py [--rounds 30] [--json FILE]
    PYTHONPATH=$(scripts/vllm_env.sh 0.33) .venv/bin/python benchmarks/scheduler_vs_mooncake.py
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import test_scheduler_cost as tsc  # noqa: E402
from run_info import RunInfo  # noqa: E402


def _once(name: str, events: list, geom: object) -> float:
    _, _, play, evs = tsc._prepare(name, events, geom)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        tsc._play_all(play, evs)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _calls(name: str, events: list, geom: object) -> int:
    _, _, play, evs = tsc._prepare(name, events, geom)
    pr = cProfile.Profile()
    pr.enable()
    tsc._play_all(play, evs)
    pr.disable()
    return int(pstats.Stats(pr).total_calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = ap.parse_args(argv)
    info = RunInfo.start()
    figures: dict[str, dict[str, float]] = {}
    for wl, (convs, turns) in tsc.WORKLOADS.items():
        events, steps, geom = tsc.record(convs, turns)
        times: dict[str, list[float]] = {"tailproof": [], "mooncake": []}
        for r in range(args.rounds + 2):  # two warm-up rounds, untimed
            order = ("tailproof", "mooncake") if r % 2 else ("mooncake", "tailproof")
            for name in order:
                t = _once(name, events, geom)
                if r >= 2:
                    times[name].append(t)
        ratios = [a / b for a, b in zip(times["tailproof"], times["mooncake"], strict=True)]
        calls = {n: _calls(n, events, geom) for n in times}
        print(f"{wl} ({steps} steps, {len(events)} calls): "
              f"tailproof {1e3 * min(times['tailproof']):.2f} / "
              f"{1e3 * statistics.median(times['tailproof']):.2f} ms, "
              f"mooncake {1e3 * min(times['mooncake']):.2f} / "
              f"{1e3 * statistics.median(times['mooncake']):.2f} ms (min / median); "
              f"tailproof / mooncake paired min {min(ratios):.3f} median "
              f"{statistics.median(ratios):.3f}; function calls {calls['tailproof']} / "
              f"{calls['mooncake']}", flush=True)
        figures[wl] = {"steps": steps, "calls_replayed": len(events),
                       "tailproof_ms_min": round(1e3 * min(times["tailproof"]), 3),
                       "tailproof_ms_median": round(1e3 * statistics.median(times["tailproof"]), 3),
                       "mooncake_ms_min": round(1e3 * min(times["mooncake"]), 3),
                       "mooncake_ms_median": round(1e3 * statistics.median(times["mooncake"]), 3),
                       "ratio_min": round(min(ratios), 3),
                       "ratio_median": round(statistics.median(ratios), 3),
                       "function_calls_tailproof": calls["tailproof"],
                       "function_calls_mooncake": calls["mooncake"]}
    info.finish({"benchmark": "scheduler_vs_mooncake", "rounds": args.rounds,
                 "ratio": "tailproof / mooncake", "workloads": figures}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
