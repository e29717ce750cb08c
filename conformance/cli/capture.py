"""``tailproof capture``: a named workload on vLLM 0.33's real Scheduler, recorded."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.cli.running import resolve_adapters, signals_unwind
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.errors import OK, UsageError
from tailproof.conformance.tools.capture_engine.run import CaptureError, capture, check_arguments
from tailproof.conformance.tools.capture_engine.workloads import GEOMETRIES, WORKLOADS


def cmd_capture(args: argparse.Namespace) -> int:
    """Run a named workload on vLLM's real Scheduler (CPU) with the recorder attached."""
    t_start = time.perf_counter()

    if args.max_bytes is not None and args.max_bytes <= 0:
        raise UsageError(f"--max-bytes must be > 0, got {args.max_bytes}",
                         "pass a size in bytes, e.g. 100000000")
    try:
        check_arguments(args.workload, args.connector, args.geometry)
    except CaptureError as e:
        raise UsageError(str(e), "see tailproof capture --help") from None
    info = vllm_compat.inspect_vllm(["vllm"])
    resolve_adapters(["vllm"], skip_missing=False, info=info)
    try:
        # SIGTERM unwinds like Ctrl-C: the recorder closes its file, the engine shuts down
        with signals_unwind():
            res = capture(args.workload, args.output, seed=args.seed, connector=args.connector,
                          geometry=args.geometry, redact=args.redact, max_bytes=args.max_bytes)
    except CaptureError as e:
        raise UsageError(str(e), "see tailproof capture --help") from None
    except OSError as e:
        raise UsageError(f"-o/--output: cannot write {args.output}: {e.strerror or e}",
                         "name a writable file") from None
    out = sys.stderr if args.json else sys.stdout
    extra = (f"; unmodelled calls: {res.unmodelled}" if res.unmodelled else "")
    print(f"captured {args.workload}: {res.ops} ops, {res.steps} engine steps -> "
          f"{res.path}{extra}", file=out)
    if args.json:
        print(json.dumps(report.command_document(
            "capture", vllm=info.as_json(), result="captured", exit_code=OK,
            total_seconds=time.perf_counter() - t_start,
            body={"workload": args.workload, "seed": args.seed, "connector": args.connector,
                  "output": str(res.path), "ops": res.ops, "steps": res.steps,
                  "unmodelled": res.unmodelled}), indent=2))
    return OK


def register_capture(sub: Any) -> None:
    cap = add_command(sub, "capture", "run a named workload on vLLM 0.33's real Scheduler (CPU, "
                      "weightless model) and record it as a trace", cmd_capture)
    cap.add_argument("--workload", required=True, metavar="NAME",
                     help=f"one of: {', '.join(WORKLOADS)}")
    cap.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="the trace to write")
    cap.add_argument("--seed", type=int, default=0, help="seed of the workload's choices")
    cap.add_argument("--connector", default="none", choices=["none", "tailproof", "mooncake"],
                     help="KV connector the scheduler runs with: none; tailproof "
                          "(TailproofConnector on the in-process memory store); or mooncake "
                          "(vLLM 0.33's MooncakeStoreConnector and its store sending thread "
                          "over an embedded in-memory store, no Mooncake master; loads land "
                          "in the step that issued them, no bytes moved). Worker ranks run "
                          "in-process; the connector's calls and store runs are recorded as "
                          "connector ops. store_failures and two_workers need a connector")
    cap.add_argument("--geometry", default=None, metavar="G",
                     help=f"block geometry, one of: {', '.join(GEOMETRIES)} "
                          "(unset: fa16-m16-h4)")
    cap.add_argument("--redact", action="store_true",
                     help="canonical token ids that keep only what hashing sees")
    cap.add_argument("--max-bytes", type=int, default=None, metavar="N",
                     help="rotate into segments past N bytes (unset: one file)")
    cap.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (text goes to stderr)")
