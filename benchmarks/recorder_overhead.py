"""Cost of the live-engine trace recorder on vLLM 0.33's real Scheduler (CPU).

Each round runs the same named workload on fresh engines, plain and with the recorder
attached (streaming to a file in a temp folder), interleaved (A,B,A,B... then B,A,B,A...),
``--repeats`` times each, keeping each side's fastest run of the round. Every engine call the
workload makes (``schedule`` + ``update_from_output`` per step, aborts, prefix-cache resets)
is timed in thread CPU time (``time.thread_time``: the machine is shared, so wall time would
mostly measure the other processes). The ratio recorded/plain of each round is one paired
sample; min and median over rounds are printed with the machine load.
The recorder's writer thread builds, encodes and writes the ops off the scheduler's thread;
its cost is shown too: the whole process's CPU time for the run (``time.process_time``, both
threads, closing the trace included), paired the same way. The last recorded trace is then
replayed on ``reference`` and ``vllm`` with strict block ids: a trace that does not replay
with 0 divergences fails the run (exit 1), so only a recorder that records correctly is timed.

Run: ``python -m benchmarks.recorder_overhead [--workload mixed] [--rounds 7] [--repeats 3]
[--redact]`` (figures in ``BENCHMARKS.md``, trace capture).
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

from tailproof.conformance.capture.recorder import Recorder
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.replay import run_trace
from tailproof.conformance.tools.capture_engine.engine import CaptureEngine
from tailproof.conformance.tools.capture_engine.workloads import WORKLOADS


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


def run_once(workload: str, record: Path | None, redact: bool) -> tuple[float, float, int]:
    """Seconds of engine-thread time and of process CPU time for one run; ops written (0
    when not recording)."""
    w = WORKLOADS[workload]
    e = TimedEngine(seed=0, **w.engine)
    # As the vLLM plugin records.
    rec = Recorder.attach(e.sched, record, redact=redact) if record else None
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    try:
        w.run(e, random.Random(0))
    finally:
        if rec is not None:
            rec.close()
        cpu = time.process_time() - t0
        gc.enable()
        e.shutdown()
    return e.seconds, cpu, rec.writer.num_ops if rec else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="mixed", choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--redact", action="store_true")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each side per round, interleaved; the round keeps each "
                        "side's fastest (filters other processes' bursts on a shared box)")
    args = p.parse_args(argv)
    run_once(args.workload, None, False)  # warm-up: imports, first-call caches
    ratios, plain_s, rec_s, cpu_ratios = [], [], [], []
    ops = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        for r in range(args.rounds):
            order = ([False, True] if r % 2 == 0 else [True, False]) * args.repeats
            got: dict[bool, float] = {False: float("inf"), True: float("inf")}
            cpu: dict[bool, float] = {False: float("inf"), True: float("inf")}
            for recording in order:  # A,B,A,B...: each side's fastest run of the round
                t, c, n = run_once(args.workload, out if recording else None, args.redact)
                got[recording] = min(got[recording], t)
                cpu[recording] = min(cpu[recording], c)
                ops = max(ops, n)
            plain_s.append(got[False])
            rec_s.append(got[True])
            ratios.append(got[True] / got[False])
            cpu_ratios.append(cpu[True] / cpu[False])
        size = out.stat().st_size
        check = run_trace(load_trace(out), ["reference", "vllm"], strict=True)
    print(f"workload {args.workload} ({ops} ops, {size / 1024:.0f} KiB trace"
          f"{', redacted' if args.redact else ''}), {args.rounds} rounds x {args.repeats} "
          f"interleaved runs per side, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"  plain engine time   : median {statistics.median(plain_s) * 1e3:.1f} ms")
    print(f"  recorded engine time: median {statistics.median(rec_s) * 1e3:.1f} ms")
    print(f"  recorded/plain      : min {min(ratios):.3f}  median "
          f"{statistics.median(ratios):.3f}  (paired per round)")
    print(f"  process CPU, both threads, recorded/plain: min {min(cpu_ratios):.3f}  median "
          f"{statistics.median(cpu_ratios):.3f}")
    divergences = len(check.divergences)
    print(f"  recorded trace replayed on reference,vllm --strict-ids: {len(check.trace.ops)} ops,"
          f" {divergences} divergences")
    return 1 if divergences or check.skipped() else 0


if __name__ == "__main__":
    raise SystemExit(main())
