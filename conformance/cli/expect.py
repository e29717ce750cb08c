"""``tailproof expect`` (formerly ``tailproof record``, still accepted): write one adapter's
observations into traces as expectations. Not the recorder (``TAILPROOF_RECORD``, which records
what an engine did); see docs/glossary.md, "Tooling"."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.cli.running import resolve_adapters
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness import vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.errors import OK, UsageError
from tailproof.conformance.harness.replay import (
    run_trace,
)


def cmd_expect(args: argparse.Namespace) -> int:
    """Fill each op's ``expect`` from one adapter's observations (for authoring cases);
    written to ``-o FILE``, to stdout, or back into each trace with ``--in-place``."""
    if args.output and args.in_place:
        raise UsageError("-o/--output: give either -o FILE or --in-place, not both",
                         "drop one of them")
    info = vllm_compat.inspect_vllm([args.adapter])
    resolve_adapters([args.adapter], skip_missing=False, info=info)
    traces = load_all(args.traces)
    if len(traces) > 1 and not args.in_place:
        raise UsageError(f"traces: {len(traces)} traces given; -o and stdout take one",
                         "fill one trace, or pass --in-place")
    for trace in traces:
        result = run_trace(trace, [args.adapter], strict=True)
        if args.adapter in result.refused:
            raise UsageError(f"{trace.source}: {result.refused[args.adapter]}",
                             "fill it with --adapters reference")
        obs = result.observations[args.adapter]
        doc = trace.raw
        for op_doc, o in zip(doc["ops"], obs, strict=True):
            if o is not None and (args.overwrite or "expect" not in op_doc):
                op_doc["expect"] = o
        text = json.dumps(doc, indent=1) + "\n"
        n = sum(o is not None for o in obs)
        target = trace.source if args.in_place else args.output
        if target is None:
            sys.stdout.write(text)
            print(f"wrote {n} expectations of {trace.source}", file=sys.stderr)
            continue
        try:
            Path(target).write_text(text)
        except OSError as e:
            raise UsageError(f"{target}: cannot write: {e.strerror or e}",
                             "make the file writable") from None
        print(f"wrote {n} expectations into {target}", file=sys.stderr)
    return OK


def register_expect(sub: Any) -> None:
    rec = add_command(sub, "expect", "write one adapter's observations into traces as expectations",
                      cmd_expect, aliases=("record",))
    rec.add_argument("traces", nargs="+", metavar="TRACE",
                     help="trace files, or directories of them (several need --in-place)")
    rec.add_argument("--adapters", "--adapter", dest="adapter", default="vllm",
                     choices=list(ADAPTERS), metavar="A",
                     help="the one adapter whose observations become the expectations "
                          f"(known: {', '.join(ADAPTERS)}; --adapter is the older spelling)")
    rec.add_argument("--overwrite", action="store_true",
                     help="replace expectations already written (default: keep them)")
    rec.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="write the filled trace here (unset: stdout)")
    rec.add_argument("--in-place", action="store_true", help="rewrite each trace file")
