"""``tailproof prove``: every lemma, the bounded check, the induction step and the mutants.

Prints a table (property, method, bound, result, seconds) or, with ``--json``, one object with
``properties``, ``mutants`` and ``findings``. Exit status 1 if a proof fails (counterexample
or unknown) or a mutant survives, else 0. ``--export DIR`` also writes every mappable mutant
counterexample as a conformance trace ``spec_<mutant>.json``; ``--quick`` lowers the bounds.

Why here and not in ``spec/``: the proofs are the spec's (``tailproof.spec.prove``), but writing
their counterexamples as traces is the harness's (``spec_export``), and the spec imports nothing
of the harness (the import contracts in pyproject.toml).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.harness.errors import UsageError


def main(argv: list[str]) -> int:
    """CLI entry (wired into ``tailproof prove``)."""
    # deferred: z3 and hypothesis are optional (``pip install -e .[spec]``); the CLI starts
    # without them and ``cmd_prove`` says what to install (exit 2)
    from tailproof.conformance.tools.spec_export import writer
    from tailproof.spec import prove

    ap = argparse.ArgumentParser(prog="tailproof prove", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="lower bounds (a few seconds)")
    ap.add_argument("--export", type=Path, help="write mutant counterexample traces here")
    ap.add_argument("--jobs", "-j", type=int, default=None,
                    help="worker processes (default: the CPUs this process may use)")
    ap.add_argument("--no-symmetry", action="store_true",
                    help="bounded search without symmetry reduction (compare state counts)")
    args = ap.parse_args([a for a in argv if a != "--"])  # `tailproof prove -- --quick`
    if args.jobs is not None and args.jobs < 1:
        print(f"tailproof: --jobs must be >= 1, got {args.jobs} (fix: --jobs 2)",
              file=sys.stderr)
        return 2
    jobs = args.jobs or prove.default_jobs()
    t0 = time.monotonic()
    export = writer(args.export) if args.export is not None else None
    report = prove.run(quick=args.quick, export=export, progress=prove.stderr_progress(t0),
                       jobs=jobs, symmetry=not args.no_symmetry)
    report["seconds"] = round(time.monotonic() - t0, 3)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        prove.print_table(report)
        print(f"\ntotal {report['seconds']:.1f}s wall, {report['cpu_seconds']:.1f}s CPU "
              f"in {jobs} worker{'s' if jobs > 1 else ''}")
    return 1 if prove.failed(report) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def require_prover() -> None:
    for module, dist in (("z3", "z3-solver"), ("hypothesis", "hypothesis")):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"the proofs need {dist}, which is not installed",
                             f"pip install {dist} (or ./scripts/bootstrap.sh), or --no-prove")


def cmd_prove(args: argparse.Namespace) -> int:
    require_prover()
    if args.export is not None and not Path(args.export).is_dir():
        raise UsageError(f"--export: {args.export} is not a directory", "create it first")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: {args.jobs} is not a number of processes", "--jobs 2")
    argv = (["--json"] if args.json else []) + (["--quick"] if args.quick else [])
    argv += ["--export", str(args.export)] if args.export is not None else []
    argv += ["--jobs", str(args.jobs)] if args.jobs is not None else []
    argv += ["--no-symmetry"] if args.no_symmetry else []
    return main(argv)


def register_prove(sub: Any) -> None:
    pr = add_command(sub, "prove", "run the spec's lemmas, bounded checks and mutants (progress on "
                     "stderr; findings about vLLM reported apart, never as failures)", cmd_prove)
    pr.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    pr.add_argument("--quick", action="store_true", help="lower bounds (a few seconds)")
    pr.add_argument("--export", default=None, metavar="DIR",
                    help="write each mutant counterexample as a conformance trace into DIR")
    pr.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                    help="worker processes for the independent checks (default: usable CPUs)")
    pr.add_argument("--no-symmetry", action="store_true",
                    help="bounded search without symmetry reduction (to compare state counts)")
