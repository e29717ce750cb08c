"""``tailproof replay``: replay traces on adapters and compare their observations."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tailproof.conformance.cli.options import (
    SpelledOption,
    add_command,
    add_report_options,
    add_store_options,
    check_junit,
    parse_adapters,
    spelling,
)
from tailproof.conformance.cli.output import (
    finish_report,
    history_findings,
    print_divergences,
    print_refusals,
    vllm_line,
)
from tailproof.conformance.cli.running import resolve_adapters, run_conformance
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.replay import (
    check_replayed,
)
from tailproof.conformance.tools.show import check_expect_keys, format_show, parse_range


def cmd_replay(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    out = sys.stderr if args.json else sys.stdout
    wanted = parse_adapters(args.adapters, spelling(args, "adapters", "--adapters"))
    info = vllm_compat.inspect_vllm(wanted)
    adapters, not_run = resolve_adapters(wanted, skip_missing=False, info=info)
    check_junit(args)
    traces = load_all(args.traces)
    results, seconds = run_conformance(args, traces, adapters, args.strict_ids, progress=False)

    for r in results:
        check_expect_keys(r)
        check_replayed(r)
    if args.show:
        for r in results:
            print(format_show(r, parse_range(args.ops, len(r.trace.ops))), file=out)
            print(file=out)
    print_divergences(results, out, per_case=None)
    print_refusals(results, out)
    n_div = sum(len(r.divergences) for r in results)
    print(f"{len(results)} cases, {sum(len(t.ops) for t in traces)} ops, {n_div} divergences, "
          f"{seconds:.1f}s ({', '.join(adapters)}{', strict ids' if args.strict_ids else ''}; "
          f"{vllm_line(info)})", file=out)

    proofs = report.proofs_part(None, "replay runs no proofs", False)
    return finish_report(args, "replay", info, adapters, not_run, args.strict_ids, results, seconds,
                         proofs, history_findings(results, out, static=False), t_start)


def register_replay(sub: Any) -> None:
    r = add_command(sub, "replay", "replay traces on adapters and compare their observations",
                    cmd_replay)
    r.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files, or directories standing for their *.json")
    r.add_argument("--adapters", "--against", dest="adapters", action=SpelledOption,
                   default="reference,vllm", metavar="A,B",
                   help=f"comma-separated adapters (known: {', '.join(ADAPTERS)}; --against is "
                   "the older spelling)")
    r.add_argument("--strict-ids", action="store_true",
                   help="compare block ids exactly instead of up to a renaming")
    r.add_argument("--show", action="store_true",
                   help="print every op with each adapter's observation side by side")
    r.add_argument("--ops", default=None, metavar="A:B",
                   help="with --show: only ops A..B-1 (unset: all)")
    add_report_options(r)
    add_store_options(r)
