"""Reading the traces a command is given: files, or directories standing for their
``*.json``; every one validated before any runs."""

from __future__ import annotations

import sys
from pathlib import Path

from tailproof.conformance.format.trace import Trace, TraceError, load_trace
from tailproof.conformance.harness.errors import UsageError


def expand_paths(args: list[str]) -> tuple[list[Path], list[str]]:
    """Trace arguments as files (a directory stands for its ``*.json``), plus the problems."""
    paths: list[Path] = []
    problems: list[str] = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            found = sorted(x for x in p.glob("*.json") if x.is_file())
            if not found:
                problems.append(f"{p}: directory holds no *.json traces")
            paths += found
        else:
            paths.append(p)
    return paths, problems


def load_all(args: list[str] | list[Path]) -> list[Trace]:
    """Validate every trace before running any; report every bad one, then exit 2."""
    paths, problems = expand_paths([str(a) for a in args])
    traces = []
    for p in paths:
        try:
            traces.append(load_trace(p))
        except TraceError as e:
            problems.append(str(e))
    if problems:
        for line in problems[:-1]:
            print(f"tailproof: {' '.join(line.split())}", file=sys.stderr)
        raise UsageError(problems[-1] + (f" ({len(problems)} bad inputs)"
                                         if len(problems) > 1 else ""),
                         "correct the trace (docs/trace-format.md)")
    return traces
