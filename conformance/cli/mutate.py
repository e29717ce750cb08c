"""The ``tailproof mutate`` subcommand (also run by ``tailproof check --mutate``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.errors import DIVERGED, OK, UsageError
from tailproof.conformance.tools.mutate import impl_extension as ext
from tailproof.conformance.tools.mutate.catalog import MUTANTS, module_label
from tailproof.conformance.tools.mutate.run import format_report, run_mutants, select
from tailproof.conformance.tools.mutate.workload import build_workload

#: The generators' fixed budget: traces drawn (derandomized) per generator.
DEFAULT_GENERATED_CORE = 120
DEFAULT_GENERATED_CONNECTOR = 60
DEFAULT_GENERATED_WINDOW = 12  # connector traces with a sliding-window group, on top
DEFAULT_MIN_SCORE = 0.95


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sample", type=int, metavar="N",
                   help="run a fixed sample of N mutants (every k-th in catalog order)")
    p.add_argument("--module", metavar="M",
                   help="only mutants of modules whose label contains M (e.g. block_pool)")
    p.add_argument("--mutant", action="append", metavar="ID", help="only this mutant (repeat)")
    p.add_argument("--jobs", type=int, default=2, help="mutants run in parallel (default 2)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a mutant's run counts as killed by timeout")
    p.add_argument("--generated", type=int, default=DEFAULT_GENERATED_CORE, metavar="N",
                   help=f"generated core traces (default {DEFAULT_GENERATED_CORE})")
    p.add_argument("--generated-connector", type=int, default=DEFAULT_GENERATED_CONNECTOR,
                   metavar="N", help="generated connector traces "
                   f"(default {DEFAULT_GENERATED_CONNECTOR})")
    p.add_argument("--generated-window", type=int, default=DEFAULT_GENERATED_WINDOW,
                   metavar="N", help="generated connector traces with a sliding-window group, "
                   f"counted with the connector traces (default {DEFAULT_GENERATED_WINDOW})")
    p.add_argument("--min-score", type=float, default=DEFAULT_MIN_SCORE,
                   help="exit 1 when the killed share of non-equivalent mutants is lower")
    p.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    p.add_argument("--extension", action="store_true",
                   help="instead: the turn-end checkpoint extension's mutants of tailproof.impl "
                        "(impl_extension.py) against the conn_x cases on reference,impl")


def _progress(i: int, n: int, r: Any) -> None:
    where = ""
    if r.killed_by:
        k = r.killed_by
        where = (f" by {k['trace']}[{k['op_index']}] {k['op']}" if "trace" in k
                 else f" ({', '.join(f'{a}={b}' for a, b in k.items())})")
    print(f"  [{i}/{n}] {r.id}: {r.status}{where} ({r.seconds:.1f}s)", file=sys.stderr,
          flush=True)


def run_from_args(args: argparse.Namespace, quiet: bool = False) -> Any:
    """Build the workload and run the selected mutants; returns the ``Report``."""

    chosen = select(args.module, args.sample, args.mutant)
    workload = build_workload(corpus_paths(), args.generated, args.generated_connector,
                              generated_window=args.generated_window)
    if not quiet:
        c = workload.counts()
        print(f"tailproof mutate: {len(chosen)} mutants; workload {c['corpus']} cases + "
              f"{c['generated-core']} generated core + {c['generated-connector']} generated "
              f"connector traces ({c['ops']} ops, {c['dropped']} dropped: unmutated vLLM "
              f"differs); built in {workload.seconds_build:.0f}s, baseline "
              f"{workload.seconds_baseline:.0f}s", file=sys.stderr, flush=True)
    return run_mutants(chosen, workload, jobs=max(1, args.jobs), timeout_s=args.timeout,
                       progress=None if quiet else _progress)


def _check_args(args: argparse.Namespace) -> None:
    for name, value in (("--sample", args.sample), ("--jobs", args.jobs),
                        ("--timeout", args.timeout)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be > 0, got {value}", "pass a positive number")
    for name, value in (("--generated", args.generated),
                        ("--generated-connector", args.generated_connector),
                        ("--generated-window", args.generated_window)):
        if value < 0:
            raise UsageError(f"{name} must be >= 0, got {value}", "pass 0 or more traces")
    if not 0.0 <= args.min_score <= 1.0:
        raise UsageError(f"--min-score must be within [0, 1], got {args.min_score}",
                         "pass a share, e.g. 0.95")


def _cmd_extension(args: argparse.Namespace) -> int:
    """``--extension``: each impl mutant of the extension, applied in this process, against
    the extension cases; exit 1 when one survives."""
    chosen = [m for m in ext.MUTANTS if not args.mutant or m.id in args.mutant]
    if not chosen:
        raise UsageError(f"no extension mutant matches {args.mutant!r}",
                         f"use one of {', '.join(m.id for m in ext.MUTANTS)}")
    if args.list:
        for m in chosen:
            print(f"{m.id:<40} {m.module}.{m.qualname}: {m.why}")
        return OK
    kills = ext.score(chosen)
    if args.json:
        print(json.dumps({m: None if k is None else {"trace": k[0], "op_index": k[1], "op": k[2]}
                          for m, k in kills.items()}, indent=2))
    for m, k in kills.items():
        where = f"killed by {k[0]}[{k[1]}] {k[2]}" if k else "SURVIVED"
        print(f"  {m}: {where}", file=sys.stderr if args.json else sys.stdout)
    return OK if all(kills.values()) else DIVERGED


def cmd_mutate(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.extension:
        return _cmd_extension(args)
    chosen = select(args.module, args.sample, args.mutant)
    if not chosen:
        raise UsageError(f"no mutant matches (--module {args.module!r}, --mutant "
                         f"{args.mutant!r})", "use one of the modules "
                         f"{', '.join(sorted({module_label(m.module) for m in MUTANTS}))} "
                         "or an id from --list")
    if args.list:
        for m in chosen:
            print(f"{m.id:<40} {module_label(m.module)}.{m.qualname}: {m.why}")
        return OK
    report = run_from_args(args)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(format_report(report))
    return OK if report.score >= args.min_score else DIVERGED


def register_mutate(sub: Any) -> None:
    mu = add_command(sub, "mutate", "score the suite against mutants of the installed vLLM's own "
                     "partial-tail code (0.33 or 0.34; corpus plus the generators' fixed budget)",
                     cmd_mutate)
    mu.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    add_arguments(mu)
