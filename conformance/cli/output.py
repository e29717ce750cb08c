"""What a run prints and reports: stdout kept for the verdict, divergences, refusals, the
vLLM line, the open upstream bugs seen, and the JSON report with the exit status."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.errors import DIVERGED, OK
from tailproof.conformance.harness.replay import (
    CaseResult,
    format_divergence,
)
from tailproof.conformance.tools.history import findings as history


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Inside: everything written to stdout, by this process (Python or native code) or by a
    child it starts (which inherits file descriptor 1), goes to stderr. A command whose stdout
    is its verdict (``--json``: one document) prints it after the block."""
    out = sys.stdout
    out.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        out.flush()  # what a logger wrote through the old stream: still to stderr
        os.dup2(saved, 1)
        os.close(saved)


def print_divergences(results: list[CaseResult], out: TextIO, per_case: int | None) -> None:
    for r in results:
        for d in r.divergences[:per_case]:
            print(format_divergence(r, d), file=out)
            print(file=out)


def _refusal_label(why: str) -> str:
    """``config.connector.X is on: ...`` -> ``X (not in vLLM)``; ``config.vllm is 0.33:
    ...`` -> ``vllm 0.33 (another release)``; other reasons whole."""
    if why.startswith("config.vllm is "):
        return f"vllm {why.split(' is ', 1)[1].split(':', 1)[0]} (another release)"
    if why.startswith("config.") and " is " in why:
        key = why.split(" is ", 1)[0].rsplit(".", 1)[-1]
        return f"{key} (not in vLLM)" if "not in vLLM" in why else key
    return why


def print_refusals(results: list[CaseResult], out: TextIO) -> None:
    """One line per adapter that refused cases (``adapters.refusal``): how many, and why."""
    refused: dict[str, list[str]] = {}
    for r in results:
        for a, why in r.refused.items():
            refused.setdefault(a, []).append(why)
    for a, whys in refused.items():
        # One count per distinct reason (a corpus mixes extension and pin-rule cases); a
        # config switch is named by its key, the full sentence is in the JSON report.
        by_reason = Counter(_refusal_label(w.split(": ", 1)[-1]) for w in whys)
        reasons = "; ".join(f"{n} {why}" for why, n in by_reason.most_common())
        print(f"not run on {a}: {len(whys)} case(s) ({reasons})", file=out)


def vllm_line(info: vllm_compat.VllmInfo) -> str:
    if info.version is None:
        return "vLLM not installed"
    return f"vLLM {info.version} ({info.source})"


def finish_report(args: argparse.Namespace, command: str, info: vllm_compat.VllmInfo,
                  adapters: list[str], not_run: dict[str, str], strict: bool,
                  results: list[CaseResult], seconds: float, proofs: dict[str, Any],
                  findings: list[dict[str, Any]], t_start: float,
                  mutation: dict[str, Any] | None = None) -> int:
    conformance = report.conformance_part(results, seconds)
    rc = DIVERGED if conformance["divergences"] or proofs["status"] == "failed" else OK
    if mutation is not None and not mutation["passed"]:
        rc = DIVERGED
    doc = report.document(command, vllm=info.as_json(), adapters=adapters, not_run=not_run,
                          strict_ids=strict, conformance=conformance, proofs=proofs,
                          findings=findings, exit_code=rc,
                          total_seconds=time.perf_counter() - t_start, mutation=mutation)
    if args.junit:
        report.write_junit(doc, Path(args.junit))
    if args.json:
        print(json.dumps(doc, indent=2))
    return rc


def history_findings(results: list[CaseResult], out: TextIO,
                     static: bool) -> list[dict[str, Any]]:
    """The open upstream bugs the replayed cases (and, for ``check``, the installed vLLM)
    exhibit: findings, never failures (``conformance/tools/history/findings.py``)."""
    found = history.trace_findings(results) + (history.static_findings() if static else [])
    history.print_findings(found, out)
    return found
