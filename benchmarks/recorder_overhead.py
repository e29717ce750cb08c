"""Cost of the live-engine trace recorder on vLLM 0.33's real Scheduler (CPU).

Each round runs the same named workload twice on fresh engines -- once plain, once with the
recorder attached (streaming to a file in a temp folder) -- in alternating order (A,B then
B,A), and times every engine call the workload makes (``schedule`` + ``update_from_output``
per step, aborts, prefix-cache resets) in thread CPU time (``time.thread_time``: the machine is
shared, so wall time would mostly measure the other processes). The ratio recorded/plain of
each round is one paired sample; min and median over rounds are printed with the machine load.

Run: ``python -m benchmarks.recorder_overhead [--workload mixed] [--rounds 7] [--redact]``
(figures in ``BENCHMARKS.md`` §5).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tailproof.conformance.capture.engine import CaptureEngine
from tailproof.conformance.capture.recorder import Recorder
from tailproof.conformance.capture.workloads import WORKLOADS


class TimedEngine(CaptureEngine):
    """A capture engine that sums the time spent in the engine's own calls."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seconds = 0.0

    def step(self) -> dict[str, int]:
        t = time.thread_time()
        out = super().step()
        self.seconds += time.thread_time() - t
        return out

    def abort(self, rid: str) -> None:
        t = time.thread_time()
        super().abort(rid)
        self.seconds += time.thread_time() - t

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        t = time.thread_time()
        out = super().reset_prefix_cache(reset_running_requests)
        self.seconds += time.thread_time() - t
        return out


def run_once(workload: str, record: Path | None, redact: bool) -> tuple[float, int]:
    """Seconds of engine time for one run; ops written (0 when not recording)."""
    w = WORKLOADS[workload]
    e = TimedEngine(seed=0, **w.engine)
    # As the vLLM plugin records (compact=False: no per-token run-length pass).
    rec = Recorder.attach(e.sched, record, redact=redact, compact=False) if record else None
    gc.collect()
    gc.disable()
    try:
        w.run(e, random.Random(0))
    finally:
        gc.enable()
        if rec is not None:
            rec.close()
        e.shutdown()
    return e.seconds, rec.writer.num_ops if rec else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="mixed", choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--redact", action="store_true")
    args = p.parse_args(argv)
    run_once(args.workload, None, False)  # warm-up: imports, first-call caches
    ratios, plain_s, rec_s = [], [], []
    ops = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            got: dict[bool, float] = {}
            for recording in order:
                got[recording], n = run_once(args.workload, out if recording else None,
                                             args.redact)
                ops = max(ops, n)
            plain_s.append(got[False])
            rec_s.append(got[True])
            ratios.append(got[True] / got[False])
        size = out.stat().st_size
    print(f"workload {args.workload} ({ops} ops, {size / 1024:.0f} KiB trace"
          f"{', redacted' if args.redact else ''}), {args.rounds} interleaved rounds, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"  plain engine time   : median {statistics.median(plain_s) * 1e3:.1f} ms")
    print(f"  recorded engine time: median {statistics.median(rec_s) * 1e3:.1f} ms")
    print(f"  recorded/plain      : min {min(ratios):.3f}  median "
          f"{statistics.median(ratios):.3f}  (paired per round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
