"""``tailproof check``: the whole corpus on every installed adapter, then the proofs."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, TextIO

from tailproof.conformance.cli.mutate import add_arguments, run_from_args
from tailproof.conformance.cli.options import (
    add_command,
    add_report_options,
    add_store_options,
    check_junit,
    parse_adapters,
)
from tailproof.conformance.cli.output import (
    finish_report,
    history_findings,
    print_divergences,
    print_refusals,
    vllm_line,
)
from tailproof.conformance.cli.prove import require_prover
from tailproof.conformance.cli.running import resolve_adapters, run_conformance
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness import report, vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.tools.mutate.run import format_report


def cmd_check(args: argparse.Namespace) -> int:
    """The main job: the whole corpus on every installed adapter, then the proofs."""
    t_start = time.perf_counter()
    run: Any = None
    if not args.no_prove:
        require_prover()
        from tailproof.spec import prove  # deferred: z3/hypothesis are optional (--no-prove)

        # Started first: the pool forks from a process without vLLM and torch loaded and proves
        # while the corpus replays (``tailproof prove --jobs``: the same report).
        run = prove.ProofRun(quick=args.quick, jobs=prove.default_jobs())
    try:
        return _check(args, t_start, run)
    finally:
        if run is not None:
            run.close()


def _check(args: argparse.Namespace, t_start: float, run: Any) -> int:
    out = sys.stderr if args.json else sys.stdout
    wanted = parse_adapters(args.adapters, "--adapters") if args.adapters else list(ADAPTERS)
    info = vllm_compat.inspect_vllm(wanted)
    adapters, not_run = resolve_adapters(wanted, skip_missing=True, info=info)
    check_junit(args)
    traces = load_all(corpus_paths())
    print(f"tailproof check: {len(traces)} cases on {', '.join(adapters)} ({vllm_line(info)})"
          + (f"; not run: {'; '.join(not_run.values())}" if not_run else ""), file=sys.stderr)
    results, seconds = run_conformance(args, traces, adapters, strict=False, progress=True)
    print_divergences(results, out, per_case=1)
    print_refusals(results, out)
    n_div = sum(len(r.divergences) for r in results)
    print(f"conformance: {len(results)} cases, {sum(len(t.ops) for t in traces)} ops, "
          f"{n_div} divergences, {seconds:.1f}s", file=out)

    proofs = report.proofs_part(None, "--no-prove", False)
    findings: list[dict[str, Any]] = []
    if run is not None:
        from tailproof.spec import prove  # deferred: z3/hypothesis are optional (--no-prove)

        rep = prove.report(run, progress=prove.stderr_progress(run.t0))
        failed = prove.failed(rep)
        proofs = report.proofs_part(rep, None, failed)
        findings = rep["findings"]
        with contextlib.redirect_stdout(out):
            prove.print_table(rep)
        print(f"proofs: {'FAILED' if failed else 'passed'} ({rep['seconds']:.1f}s)", file=out)
    findings += history_findings(results, out, static=True)
    mutation = _check_mutation(out) if args.mutate else None
    return finish_report(args, "check", info, adapters, not_run, False, results, seconds, proofs,
                         findings, t_start, mutation)


def _check_mutation(out: TextIO) -> dict[str, Any]:
    """``check --mutate``: the whole vLLM mutant catalog under the corpus and the generators'
    default budget; the score becomes the report's ``mutation`` part."""

    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = p.parse_args([])
    rep = run_from_args(opts)
    print(format_report(rep), file=out)
    return {**rep.as_json(), "min_score": opts.min_score,
            "passed": rep.score >= opts.min_score}


def register_check(sub: Any) -> None:
    c = add_command(sub, "check", "run the corpus on every installed adapter, then the proofs",
                    cmd_check)
    c.add_argument("--adapters", default=None, metavar="A,B",
                   help="comma-separated adapters to run (default: every adapter whose "
                        f"packages are installed; known: {', '.join(ADAPTERS)})")
    c.add_argument("--no-prove", action="store_true", help="skip the spec's proofs")
    c.add_argument("--quick", action="store_true",
                   help="prove with lower bounds (seconds instead of a minute or two)")
    c.add_argument("--mutate", action="store_true",
                   help="also score the suite against the vLLM mutant catalog (minutes; exit 1 "
                        "below the kit's minimum score)")
    add_report_options(c)
    add_store_options(c)
