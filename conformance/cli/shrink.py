"""``tailproof shrink``: delta-debug a diverging trace down to a small one."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tailproof.conformance.capture.writer import write_trace
from tailproof.conformance.cli.options import SpelledOption, add_command, parse_adapters, spelling
from tailproof.conformance.cli.running import resolve_adapters
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.errors import OK, UsageError
from tailproof.conformance.tools.shrink import shrink


def cmd_shrink(args: argparse.Namespace) -> int:
    """Delta-debug a diverging trace down to a small one with the same divergence."""
    t_start = time.perf_counter()

    wanted = parse_adapters(args.adapters, spelling(args, "adapters", "--adapters"))
    info = vllm_compat.inspect_vllm(wanted)
    adapters, _ = resolve_adapters(wanted, skip_missing=False, info=info)
    (trace,) = load_all([args.trace])
    why = vllm_compat.token_id_refusal([trace], adapters)
    if why is not None:
        raise UsageError(why, "use smaller token ids, or shrink against the reference only")
    out = sys.stderr if args.json else sys.stdout
    res = shrink(trace, adapters, args.strict_ids,
                 log=lambda m: print(f"  {m}", file=sys.stderr))
    adapter, against, op, field = res.signature
    print(f"shrunk {trace.source}: {res.ops_before} ops -> {res.ops_after} ops "
          f"({res.runs} replays); divergence kept: {adapter} vs {against} on {op}.{field}",
          file=sys.stderr if args.output is None else out)
    if args.output is not None:
        try:
            write_trace(res.doc, args.output)
        except OSError as e:
            raise UsageError(f"-o/--output: cannot write {args.output}: {e.strerror or e}",
                             "name a writable file") from None
    elif not args.json:
        sys.stdout.write(json.dumps(res.doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(report.command_document(
            "shrink", vllm=info.as_json(), result="shrunk", exit_code=OK,
            total_seconds=time.perf_counter() - t_start,
            body={"source": trace.source, "adapters": adapters, "strict_ids": args.strict_ids,
                  "ops_before": res.ops_before, "ops_after": res.ops_after,
                  "replays": res.runs, "output": args.output,
                  "divergence": {"adapter": adapter, "against": against, "op": op,
                                 "field": field},
                  "trace": res.doc if args.output is None else None}), indent=2))
    return OK


def register_shrink(sub: Any) -> None:
    sh = add_command(sub, "shrink", "delta-debug a diverging trace to a small one that keeps "
                     "the same divergence (op kind and field)", cmd_shrink)
    sh.add_argument("trace", metavar="TRACE", help="a trace that diverges")
    sh.add_argument("--adapters", "--against", dest="adapters", action=SpelledOption,
                    default="reference,vllm", metavar="A,B",
                    help=f"comma-separated adapters (known: {', '.join(ADAPTERS)}; --against is "
                    "the older spelling)")
    sh.add_argument("--strict-ids", action="store_true",
                    help="compare block ids exactly instead of up to a renaming")
    sh.add_argument("-o", "--output", default=None, metavar="FILE",
                    help="write the small trace here (unset: stdout)")
    sh.add_argument("--json", action="store_true",
                    help="print one JSON document on stdout (the small trace inside it "
                         "unless -o); text goes to stderr")
