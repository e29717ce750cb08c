"""The ``tailproof history`` subcommand: bug -> status per release -> covering case or finding
-> mutant -> killed or not, for every upstream bug in ``bugs.py`` (docs/history.md).

Each bug has a status per supported release (``Bug.at``); the checks run on the installed
release's column. Fixed bugs: each mutant runs against the bug's named case alone
(``verify.py``); a mutant the case does not kill makes the exit status 1. Present bugs: the
finding's detector runs on the bug's case (replayed on ``reference`` and ``vllm-mooncake``),
on the installed vLLM, or on its ``Scheduler`` (``engine.py``); a finding that no longer shows
is reported (``reported: false``), also exit 1, since the entry's status is then out of date.
``--no-mutants`` skips the mutant runs (a few seconds each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.errors import DIVERGED, OK, UsageError
from tailproof.conformance.harness.releases import installed_release
from tailproof.conformance.harness.replay import run_trace
from tailproof.conformance.tools.history import findings as hf
from tailproof.conformance.tools.history.bugs import (
    BUGS,
    FIXED,
    PRESENT,
    RELEASES,
    Bug,
    by_ref,
)
from tailproof.conformance.tools.history.verify import case_ops, case_path, verify_bug


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--bug", action="append", metavar="REF",
                   help="only this bug (vllm#49502 or 49502; repeat)")
    p.add_argument("--no-mutants", action="store_true",
                   help="do not run the mutants (their column says not run)")
    p.add_argument("--jobs", type=int, default=2, help="mutants run in parallel (default 2)")


def _finding_shown(bug: Bug) -> dict[str, Any] | None:
    """Run the bug's finding detector; the finding dict when it shows, None when not."""
    assert bug.finding
    if bug.finding in hf.ENGINE_DETECTORS:
        return hf.engine_finding(bug.finding)
    if bug.finding in hf.STATIC_DETECTORS:
        found = hf.static_findings()
    else:

        assert bug.case, f"{bug.ref}: a trace finding needs its case"
        trace = load_trace(case_path(bug.case))
        found = hf.trace_findings([run_trace(trace, ["reference", "vllm-mooncake"], True)])
    return next((f for f in found if f["bug"] == bug.ref), None)


def _column(bug: Bug) -> dict[str, Any]:
    """One release's column of a bug (no checks run)."""
    return {"status": bug.status, "reason": bug.reason, "case": bug.case,
            "mutants": list(bug.mutants), "finding": bug.finding}


def row(entry: Bug, run_mutants: bool, jobs: int, release: str | None = None
        ) -> dict[str, Any]:
    """One bug's line of the table, with the checks of ``release``'s column run (None: the
    installed release)."""
    release = release or installed_release()
    bug = entry.at(release)
    r: dict[str, Any] = {
        "bug": bug.ref, "listed": bug.listed, "checked_on": release, "status": bug.status,
        "statement": bug.statement, "touches": bug.touches, "reason": bug.reason,
        "case": bug.case, "case_ops": case_ops(bug.case) if bug.case else None,
        "finding": bug.finding, "mutants": {}, "avoided_by": bug.avoided_by,
        "output_only": bug.output_only,
        "releases": {rel: _column(entry.at(rel)) for rel in RELEASES}}
    if bug.mutants:
        if run_mutants:
            r["mutants"] = verify_bug(bug, jobs)
        else:
            r["mutants"] = {m: {"status": "not_run", "killed": None} for m in bug.mutants}
    if bug.finding:
        f = _finding_shown(bug)
        r["reported"] = f is not None
        r["finding_message"] = f["message"] if f else None
    r["ok"] = (all(m.get("killed") is not False for m in r["mutants"].values())
               and r.get("reported", True) is not False)
    return r


def _killed_cell(r: dict[str, Any]) -> str:
    if not r["mutants"]:
        return "-"
    marks = {True: "killed", False: "SURVIVED", None: "not run"}
    return ", ".join(f"{m}: {marks[v.get('killed')]}" + (f" @op {v['op_index']}"
                                                         if v.get("killed") else "")
                     for m, v in r["mutants"].items())


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        cover = r["case"] or "-"
        if r["case_ops"] is not None:
            cover += f" ({r['case_ops']} ops)"
        if r["finding"]:
            cover += f"; finding {r['finding']}: " + ("reported" if r.get("reported")
                                                       else "NOT REPORTED")
        column = " | ".join(f"{rel}: {c['status']}" for rel, c in r["releases"].items())
        lines.append(f"{r['bug']:<14} {column}")
        lines.append(f"{'':<14} checked on {r['checked_on'] or '(no vLLM)'}: {cover}")
        lines.append(f"{'':<14} mutants: {_killed_cell(r)}")
        if r.get("finding_message"):
            lines.append(f"{'':<14} shows: {r['finding_message']}")
        if r["status"] not in (FIXED, PRESENT) or not (r["mutants"] or r["finding"]):
            lines.append(f"{'':<14} why: {r['reason']}")
    n_fixed = sum(r["status"] == FIXED for r in rows)
    n_present = sum(r["status"] == PRESENT for r in rows)
    killed = sum(bool(v.get("killed")) for r in rows for v in r["mutants"].values())
    total = sum(len(r["mutants"]) for r in rows)
    on = rows[0]["checked_on"] if rows else None
    lines.append(f"history on vLLM {on or '(none)'}: {len(rows)} bugs ({n_fixed} fixed, "
                 f"{n_present} present, {len(rows) - n_fixed - n_present} not applicable); "
                 "mutants "
                 f"killed by their named case: {killed}/{total}; findings reported: "
                 f"{sum(bool(r.get('reported')) for r in rows)}/"
                 f"{sum(bool(r['finding']) for r in rows)}")
    return "\n".join(lines)


def cmd_history(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}", "pass e.g. --jobs 2")
    bugs = BUGS
    if args.bug:
        try:
            bugs = [by_ref(b) for b in args.bug]
        except KeyError as e:
            raise UsageError(f"--bug: no entry {e.args[0]!r}",
                             "see tailproof history for the list") from None
    rows = [row(b, not args.no_mutants, args.jobs) for b in bugs]
    rc = OK if all(r["ok"] for r in rows) else DIVERGED
    out = sys.stderr if args.json else sys.stdout
    print(format_table(rows), file=out)
    if args.json:
        print(json.dumps(report.command_document(
            "history", vllm=vllm_compat.inspect_vllm(["vllm-mooncake"]).as_json(),
            result="covered" if rc == OK else "uncovered", exit_code=rc,
            total_seconds=time.perf_counter() - t0, body={"bugs": rows}), indent=2))
    return rc


def register_history(sub: Any) -> None:
    add_arguments(add_command(
        sub, "history", "list every upstream bug of the partial-tail path: its status in each "
        "supported vLLM release, the case or finding that covers it on the installed one, the "
        "mutant that re-introduces it and whether the case kills it", cmd_history))
