"""``tailproof diff``: replay traces on two installed vLLM releases and report every behaviour
change, each shrunk and explained (``conformance/tools/diff``, docs/ci.md).

Exit status: 0 every change is a documented rule change or a fixed upstream bug (or there is
none); 1 some change is unexplained; 2 bad input or a side that cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from tailproof.conformance.cli.options import add_command, check_junit, parse_adapters
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.corpus import CASES_DIR
from tailproof.conformance.harness.errors import DIVERGED, OK, UsageError
from tailproof.conformance.tools.diff.run import Differ, DiffReport, format_report
from tailproof.conformance.tools.diff.sides import Side, Worker, parse_side
from tailproof.reference.releases import RELEASES

VLLM_BACKED = ("vllm", "vllm-mooncake", "impl")
DEFAULT_FROM, DEFAULT_TO = list(RELEASES)[0], list(RELEASES)[-1]


def _side_json(side: Side, worker: Worker) -> dict[str, Any]:
    return {"side": side.text, "release": side.release, "vllm": worker.version,
            "pythonpath": side.folder}


def write_junit(rep: DiffReport, path: Path) -> None:
    """One test case per trace: an unexplained change fails, an explained one passes with
    the explanation as output, a trace not compared is skipped."""
    suites = ET.Element("testsuites", name="tailproof")
    unexplained = [c for c in rep.changes if c.kind == "unexplained"]
    suite = ET.SubElement(suites, "testsuite", name="diff", tests=str(rep.traces),
                          failures=str(len(unexplained)), skipped=str(len(rep.not_compared)),
                          time=str(round(rep.seconds, 3)))
    for c in rep.changes:
        tc = ET.SubElement(suite, "testcase", classname="diff", name=c.trace,
                           time=str(c.seconds))
        text = (f"op {c.op_index} ({c.op}.{c.field}) on {c.adapter}: {c.kind}: {c.reason}; "
                f"shrunk to {c.ops_after} ops")
        if c.kind == "unexplained":
            f = ET.SubElement(tc, "failure", message=text)
            f.text = json.dumps({"before": c.before, "after": c.after}, indent=1)
        else:
            ET.SubElement(tc, "system-out").text = text
    for name in rep.same:
        ET.SubElement(suite, "testcase", classname="diff", name=name, time="0")
    for name, why in sorted(rep.not_compared.items()):
        tc = ET.SubElement(suite, "testcase", classname="diff", name=name, time="0")
        ET.SubElement(tc, "skipped", message=why)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def cmd_diff(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    check_junit(args)
    adapters = parse_adapters(args.adapters, "--adapters")
    other = [a for a in adapters if a not in VLLM_BACKED]
    if other:
        raise UsageError(f"--adapters: {other[0]} does not run vLLM",
                         f"name some of {', '.join(VLLM_BACKED)}")
    a, b = parse_side(args.from_side, "--from"), parse_side(args.to_side, "--to")
    if (a.release, a.folder) == (b.release, b.folder):
        raise UsageError(f"--from and --to name the same vLLM ({a.text})",
                         "name two releases, or one release twice with different folders")
    traces = load_all(args.traces or [CASES_DIR])
    out = sys.stderr if args.json else sys.stdout
    say = (lambda m: print(f"  {m}", file=sys.stderr)) if args.verbose else None
    wa = Worker(a, adapters)
    try:
        wb = Worker(b, adapters)
        try:
            rep = DiffReport((_side_json(a, wa), _side_json(b, wb)), adapters)
            differ = Differ(wa, wb, adapters, say)
            for trace in traces:
                differ.compare(trace, rep)
        finally:
            wb.close()
    finally:
        wa.close()
    rep.seconds = time.perf_counter() - t0
    rc = OK if rep.explained else DIVERGED
    print(format_report(rep), file=out)
    if args.junit:
        write_junit(rep, Path(args.junit))
    if args.json:
        print(json.dumps(report.command_document(
            "diff", vllm=vllm_compat.inspect_vllm(adapters).as_json(),
            result="explained" if rc == OK else "unexplained", exit_code=rc,
            total_seconds=rep.seconds, body=rep.body()), indent=2))
    return rc


def register_diff(sub: Any) -> None:
    p = add_command(sub, "diff", "replay traces on two installed vLLM releases and report "
                    "every behaviour change: its first differing op, shrunk, and whether a "
                    "documented rule change or a fixed upstream bug explains it (exit 1: some "
                    "change is unexplained)", cmd_diff)
    p.add_argument("traces", nargs="*", metavar="TRACE",
                   help="trace files or directories (unset: the corpus)")
    p.add_argument("--from", dest="from_side", default=DEFAULT_FROM, metavar="RELEASE[=DIR]",
                   help="the release to compare from, by its scripts/vllm_env.sh folder, or "
                        "RELEASE=DIR for a folder holding a vllm package")
    p.add_argument("--to", dest="to_side", default=DEFAULT_TO, metavar="RELEASE[=DIR]",
                   help="the release to compare to, written as --from")
    p.add_argument("--adapters", default="vllm,vllm-mooncake", metavar="A,B",
                   help=f"vLLM-backed adapters to replay on (known: {', '.join(VLLM_BACKED)})")
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON document on stdout (all text goes to stderr); "
                        "schema: conformance/schema/command.schema.json")
    p.add_argument("--junit", default=None, metavar="FILE",
                   help="also write one test case per trace as JUnit XML to FILE")
    p.add_argument("--verbose", action="store_true",
                   help="say on stderr which trace is being shrunk")
