"""tailproof: replay conformance traces on the reference model, vLLM 0.33 and the tailproof
connector, compare them op by op, and prove the spec.

Exit status: 0 everything ran and agreed; 1 a divergence or a failed proof; 2 bad input or an
environment that cannot run what was asked (one line on stderr naming the cause and the fix).
Findings about vLLM never change the exit status. --debug shows the traceback of an error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tailproof import __version__
from tailproof.conformance.format.trace import Trace, TraceError, load_trace
from tailproof.conformance.harness import vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS, AdapterUnavailable, available
from tailproof.conformance.harness.errors import DIVERGED, OK, USAGE, UsageError
from tailproof.conformance.harness.replay import CaseResult, format_divergence, run_trace

CASES_DIR = Path(__file__).resolve().parents[1] / "cases"
#: exit status of a failure inside tailproof itself (a bug, never a user error)
INTERNAL = 3


def corpus_paths() -> list[Path]:
    """Every case of the shipped corpus, in name order."""
    return sorted(CASES_DIR.glob("*.json"))


# --- inputs ---------------------------------------------------------------------------------


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


def parse_adapters(text: str, option: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise UsageError(f"{option}: no adapter named", f"name some of {', '.join(ADAPTERS)}")
    for a in names:
        if a not in ADAPTERS:
            raise UsageError(f"{option}: unknown adapter {a!r}",
                             f"use some of {', '.join(ADAPTERS)}")
    return names


def resolve_adapters(names: list[str], skip_missing: bool,
                     info: vllm_compat.VllmInfo) -> tuple[list[str], dict[str, str]]:
    """The adapters that can run here. vLLM missing: skipped when ``skip_missing`` (check),
    else exit 2; an unsupported vLLM or a changed API: always exit 2 naming each problem."""
    run, not_run = [], {}
    for a in names:
        reason = vllm_compat.refusal(info, a)
        if reason is None and not available(a):
            reason = f"adapter {a}: its code does not import here"
        if reason is None:
            run.append(a)
        elif skip_missing and info.missing:
            not_run[a] = reason
        else:
            raise UsageError(reason, vllm_compat.FIX if not info.missing else
                             f"./scripts/bootstrap.sh installs {info.missing}, or run "
                             "without it (--against reference / --adapters reference)")
    if not run:
        raise UsageError(f"no adapter can run here ({'; '.join(not_run.values())})",
                         "./scripts/bootstrap.sh")
    return run, not_run


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM / SIGHUP end the run like Ctrl-C (SystemExit 128+signal), so every context
    that is open -- the master this run started -- is closed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    saved = {s: signal.signal(s, unwind) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _warn_wildcard_listeners() -> None:
    """``--mooncake-master``: the run joins a master it did not start, so it stays in the
    host's network namespace, where its Mooncake clients' listeners are wildcard (netns.py)."""
    from tailproof.conformance.harness.netns import loopback_only

    if loopback_only():  # already in a namespace with only lo: nothing else to reach them
        return
    print("tailproof: warning: --mooncake-master: this run's Mooncake clients listen on all "
          "interfaces (Mooncake binds them to the wildcard address; only a run that starts "
          "its own master moves into a private network namespace): use it on a trusted "
          "network, or leave --mooncake-master unset", file=sys.stderr)


def _isolate_network() -> None:
    """Mooncake clients listen on every interface whatever they are told: a run that starts
    its own master moves into a private loopback-only network namespace first (root only)."""
    from tailproof.conformance.harness.netns import enter_loopback_namespace

    why = enter_loopback_namespace()
    if why is not None:
        print(f"tailproof: warning: Mooncake clients of this run listen on all interfaces "
              f"(no private network namespace: {why})", file=sys.stderr)


def _impl_options(args: argparse.Namespace, adapters: list[str],
                  stack: contextlib.ExitStack) -> dict[str, dict[str, Any]]:
    """``make_driver`` options of the impl adapter (``--store``, ``--device``); for ``--store
    mooncake`` without a master address, start a ``mooncake_master`` on 127.0.0.1 for the run
    (stopped by PID when ``stack`` closes)."""
    if "impl" not in adapters or (args.store is None and args.device is None):
        return {}
    from tailproof.conformance.harness.adapters import impl as impl_adapter

    options: dict[str, Any] = {}
    if args.device is not None:
        options["device"] = args.device
    if args.store is not None:
        options["store"] = args.store
    if args.store == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            raise UsageError("--store mooncake: the Mooncake store package is not installed",
                             "pip install mooncake-transfer-engine-non-cuda (and "
                             "libibverbs1), or --store memory")
        address = args.mooncake_master
        if address:
            _warn_wildcard_listeners()
        else:
            from tailproof.conformance.harness.local_master import LocalMaster

            _isolate_network()
            stack.enter_context(_signals_unwind())
            address = stack.enter_context(LocalMaster()).address
        options["store_config"] = {"master_address": address}
    stack.callback(impl_adapter.close_shared_stores)
    return {"impl": options}


# --- running --------------------------------------------------------------------------------


def _progress(i: int, n: int, label: str, tty: bool) -> None:
    if not tty:
        if i == n:
            print(f"  {n}/{n} cases", file=sys.stderr)
        return
    width = 30
    done = width * i // max(n, 1)
    print(f"\r  [{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:40]:<40}",
          end="" if i < n else "\n", file=sys.stderr, flush=True)


def run_all(traces: list[Trace], adapters: list[str], strict: bool, progress: bool,
            options: dict[str, dict[str, Any]] | None = None) -> list[CaseResult]:
    tty = sys.stderr.isatty()
    results = []
    for i, t in enumerate(traces):
        if progress:
            _progress(i, len(traces), t.name, tty)
        results.append(run_trace(t, adapters, strict, options))
    if progress:
        _progress(len(traces), len(traces), "", tty)
    return results


def _print_divergences(results: list[CaseResult], out: TextIO, per_case: int | None) -> None:
    for r in results:
        for d in r.divergences[:per_case]:
            print(format_divergence(r, d), file=out)
            print(file=out)


def _print_refusals(results: list[CaseResult], out: TextIO) -> None:
    """One line per adapter that refused cases (``adapters.refusal``): how many, and why."""
    refused: dict[str, list[str]] = {}
    for r in results:
        for a, why in r.refused.items():
            refused.setdefault(a, []).append(why)
    for a, whys in refused.items():
        print(f"not run on {a}: {len(whys)} case(s) ({whys[0].split(': ', 1)[-1]})", file=out)


def _vllm_line(info: vllm_compat.VllmInfo) -> str:
    if info.version is None:
        return "vLLM not installed"
    return f"vLLM {info.version} ({info.source})"


def _conformance(args: argparse.Namespace, traces: list[Trace], adapters: list[str],
                 strict: bool, progress: bool) -> tuple[list[CaseResult], float]:
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        options = _impl_options(args, adapters, stack)
        results = run_all(traces, adapters, strict, progress, options)
    return results, time.perf_counter() - t0


def _finish(args: argparse.Namespace, command: str, info: vllm_compat.VllmInfo,
            adapters: list[str], not_run: dict[str, str], strict: bool,
            results: list[CaseResult], seconds: float, proofs: dict[str, Any],
            findings: list[dict[str, Any]], t_start: float,
            mutation: dict[str, Any] | None = None) -> int:
    from tailproof.conformance.harness import report

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


# --- subcommands (one function each; register_* adds its parser) ----------------------------


def cmd_check(args: argparse.Namespace) -> int:
    """The main job: the whole corpus on every installed adapter, then the proofs."""
    t_start = time.perf_counter()
    run: Any = None
    if not args.no_prove:
        _require_prover()
        from tailproof.spec import prove

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
    _check_junit(args)
    traces = load_all(corpus_paths())
    print(f"tailproof check: {len(traces)} cases on {', '.join(adapters)} ({_vllm_line(info)})"
          + (f"; not run: {'; '.join(not_run.values())}" if not_run else ""), file=sys.stderr)
    results, seconds = _conformance(args, traces, adapters, strict=False, progress=True)
    _print_divergences(results, out, per_case=1)
    _print_refusals(results, out)
    n_div = sum(len(r.divergences) for r in results)
    print(f"conformance: {len(results)} cases, {sum(len(t.ops) for t in traces)} ops, "
          f"{n_div} divergences, {seconds:.1f}s", file=out)
    from tailproof.conformance.harness import report

    proofs = report.proofs_part(None, "--no-prove", False)
    findings: list[dict[str, Any]] = []
    if run is not None:
        from tailproof.spec import prove

        rep = prove.report(run, progress=prove.stderr_progress(run.t0))
        failed = prove.failed(rep)
        proofs = report.proofs_part(rep, None, failed)
        findings = rep["findings"]
        with contextlib.redirect_stdout(out):
            prove.print_table(rep)
        print(f"proofs: {'FAILED' if failed else 'passed'} ({rep['seconds']:.1f}s)", file=out)
    findings += _history_findings(results, out, static=True)
    mutation = _check_mutation(out) if args.mutate else None
    return _finish(args, "check", info, adapters, not_run, False, results, seconds, proofs,
                   findings, t_start, mutation)


def _history_findings(results: list[CaseResult], out: TextIO,
                      static: bool) -> list[dict[str, Any]]:
    """The open upstream bugs the replayed cases (and, for ``check``, the installed vLLM)
    exhibit: findings, never failures (``conformance/tools/history/findings.py``)."""
    from tailproof.conformance.tools.history import findings as history

    found = history.trace_findings(results) + (history.static_findings() if static else [])
    history.print_findings(found, out)
    return found


def _check_mutation(out: TextIO) -> dict[str, Any]:
    """``check --mutate``: the whole vLLM mutant catalog under the corpus and the generators'
    default budget; the score becomes the report's ``mutation`` part."""
    from tailproof.conformance.cli.mutate import add_arguments, run_from_args
    from tailproof.conformance.tools.mutate.run import format_report

    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = p.parse_args([])
    rep = run_from_args(opts)
    print(format_report(rep), file=out)
    return {**rep.as_json(), "min_score": opts.min_score,
            "passed": rep.score >= opts.min_score}


def register_check(sub: Any) -> None:
    c = _sub(sub, "check", "run the corpus on every installed adapter, then the proofs",
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
    _report_args(c)
    _store_args(c)


def cmd_replay(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    out = sys.stderr if args.json else sys.stdout
    wanted = parse_adapters(args.against, "--against")
    info = vllm_compat.inspect_vllm(wanted)
    adapters, not_run = resolve_adapters(wanted, skip_missing=False, info=info)
    _check_junit(args)
    traces = load_all(args.traces)
    results, seconds = _conformance(args, traces, adapters, args.strict_ids, progress=False)
    from tailproof.conformance.format.step_protocol import check_replayed
    from tailproof.conformance.tools.show import check_expect_keys, format_show, parse_range

    for r in results:
        check_expect_keys(r)
        check_replayed(r)
    if args.show:
        for r in results:
            print(format_show(r, parse_range(args.ops, len(r.trace.ops))), file=out)
            print(file=out)
    _print_divergences(results, out, per_case=None)
    _print_refusals(results, out)
    n_div = sum(len(r.divergences) for r in results)
    print(f"{len(results)} cases, {sum(len(t.ops) for t in traces)} ops, {n_div} divergences, "
          f"{seconds:.1f}s ({', '.join(adapters)}{', strict ids' if args.strict_ids else ''}; "
          f"{_vllm_line(info)})", file=out)
    from tailproof.conformance.harness import report

    proofs = report.proofs_part(None, "replay runs no proofs", False)
    return _finish(args, "replay", info, adapters, not_run, args.strict_ids, results, seconds,
                   proofs, _history_findings(results, out, static=False), t_start)


def register_replay(sub: Any) -> None:
    r = _sub(sub, "replay", "replay traces on adapters and compare their observations",
             cmd_replay)
    r.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files, or directories standing for their *.json")
    r.add_argument("--against", default="reference,vllm", metavar="A,B",
                   help=f"comma-separated adapters (known: {', '.join(ADAPTERS)})")
    r.add_argument("--strict-ids", action="store_true",
                   help="compare block ids exactly instead of up to a renaming")
    r.add_argument("--show", action="store_true",
                   help="print every op with each adapter's observation side by side")
    r.add_argument("--ops", default=None, metavar="A:B",
                   help="with --show: only ops A..B-1 (unset: all)")
    _report_args(r)
    _store_args(r)


def cmd_record(args: argparse.Namespace) -> int:
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
                         "record one trace, or pass --in-place")
    for trace in traces:
        result = run_trace(trace, [args.adapter], strict=True)
        if args.adapter in result.refused:
            raise UsageError(f"{trace.source}: {result.refused[args.adapter]}",
                             "record it with --adapter reference")
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
            print(f"recorded {n} observations of {trace.source}", file=sys.stderr)
            continue
        try:
            Path(target).write_text(text)
        except OSError as e:
            raise UsageError(f"{target}: cannot write: {e.strerror or e}",
                             "make the file writable") from None
        print(f"recorded {n} observations into {target}", file=sys.stderr)
    return OK


def register_record(sub: Any) -> None:
    rec = _sub(sub, "record", "write one adapter's observations into traces as expectations",
               cmd_record)
    rec.add_argument("traces", nargs="+", metavar="TRACE",
                     help="trace files, or directories of them (several need --in-place)")
    rec.add_argument("--adapter", default="vllm", choices=list(ADAPTERS),
                     help="the adapter whose observations become the expectations")
    rec.add_argument("--overwrite", action="store_true",
                     help="replace expectations already written (default: keep them)")
    rec.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="write the filled trace here (unset: stdout)")
    rec.add_argument("--in-place", action="store_true", help="rewrite each trace file")


def cmd_capture(args: argparse.Namespace) -> int:
    """Run a named workload on vLLM's real Scheduler (CPU) with the recorder attached."""
    t_start = time.perf_counter()
    from tailproof.conformance.tools.capture_engine.run import (
        CaptureError,
        capture,
        check_arguments,
    )

    if args.max_bytes is not None and args.max_bytes <= 0:
        raise UsageError(f"--max-bytes must be > 0, got {args.max_bytes}",
                         "pass a size in bytes, e.g. 100000000")
    try:
        check_arguments(args.workload, args.connector, args.geometry)
    except CaptureError as e:
        raise UsageError(str(e), "see tailproof capture --help") from None
    info = vllm_compat.inspect_vllm(["vllm"])
    resolve_adapters(["vllm"], skip_missing=False, info=info)
    try:
        # SIGTERM unwinds like Ctrl-C: the recorder closes its file, the engine shuts down
        with _signals_unwind():
            res = capture(args.workload, args.output, seed=args.seed, connector=args.connector,
                          geometry=args.geometry, redact=args.redact, max_bytes=args.max_bytes)
    except CaptureError as e:
        raise UsageError(str(e), "see tailproof capture --help") from None
    except OSError as e:
        raise UsageError(f"-o/--output: cannot write {args.output}: {e.strerror or e}",
                         "name a writable file") from None
    out = sys.stderr if args.json else sys.stdout
    extra = (f"; unmodelled calls: {res.unmodelled}" if res.unmodelled else "")
    print(f"captured {args.workload}: {res.ops} ops, {res.steps} engine steps -> "
          f"{res.path}{extra}", file=out)
    if args.json:
        from tailproof.conformance.harness import report

        print(json.dumps(report.command_document(
            "capture", vllm=info.as_json(), result="captured", exit_code=OK,
            total_seconds=time.perf_counter() - t_start,
            body={"workload": args.workload, "seed": args.seed, "connector": args.connector,
                  "output": str(res.path), "ops": res.ops, "steps": res.steps,
                  "unmodelled": res.unmodelled}), indent=2))
    return OK


def register_capture(sub: Any) -> None:
    from tailproof.conformance.tools.capture_engine.workloads import GEOMETRIES, WORKLOADS

    cap = _sub(sub, "capture", "run a named workload on vLLM 0.33's real Scheduler (CPU, "
               "weightless model) and record it as a trace", cmd_capture)
    cap.add_argument("--workload", required=True, metavar="NAME",
                     help=f"one of: {', '.join(WORKLOADS)}")
    cap.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="the trace to write")
    cap.add_argument("--seed", type=int, default=0, help="seed of the workload's choices")
    cap.add_argument("--connector", default="none", choices=["none", "tailproof", "mooncake"],
                     help="KV connector the scheduler runs with: none; tailproof "
                          "(TailproofConnector on the in-process memory store); or mooncake "
                          "(vLLM 0.33's MooncakeStoreConnector and its store sending thread "
                          "over an embedded in-memory store, no Mooncake master; loads land "
                          "in the step that issued them, no bytes moved). Worker ranks run "
                          "in-process; the connector's calls and store runs are recorded as "
                          "connector ops. store_failures and two_workers need a connector")
    cap.add_argument("--geometry", default=None, metavar="G",
                     help=f"block geometry, one of: {', '.join(GEOMETRIES)} "
                          "(unset: fa16-m16-h4)")
    cap.add_argument("--redact", action="store_true",
                     help="canonical token ids that keep only what hashing sees")
    cap.add_argument("--max-bytes", type=int, default=None, metavar="N",
                     help="rotate into segments past N bytes (unset: one file)")
    cap.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (text goes to stderr)")


def cmd_shrink(args: argparse.Namespace) -> int:
    """Delta-debug a diverging trace down to a small one with the same divergence."""
    t_start = time.perf_counter()
    from tailproof.conformance.capture.writer import write_trace
    from tailproof.conformance.tools.shrink import shrink

    wanted = parse_adapters(args.against, "--against")
    info = vllm_compat.inspect_vllm(wanted)
    adapters, _ = resolve_adapters(wanted, skip_missing=False, info=info)
    (trace,) = load_all([args.trace])
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
        from tailproof.conformance.harness import report

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
    sh = _sub(sub, "shrink", "delta-debug a diverging trace to a small one that keeps the same "
              "divergence (op kind and field)", cmd_shrink)
    sh.add_argument("trace", metavar="TRACE", help="a trace that diverges")
    sh.add_argument("--against", default="reference,vllm", metavar="A,B",
                    help=f"comma-separated adapters (known: {', '.join(ADAPTERS)})")
    sh.add_argument("--strict-ids", action="store_true",
                    help="compare block ids exactly instead of up to a renaming")
    sh.add_argument("-o", "--output", default=None, metavar="FILE",
                    help="write the small trace here (unset: stdout)")
    sh.add_argument("--json", action="store_true",
                    help="print one JSON document on stdout (the small trace inside it "
                         "unless -o); text goes to stderr")


def cmd_validate(args: argparse.Namespace) -> int:
    for t in load_all(args.traces):
        print(f"ok {t.source}: {len(t.ops)} ops")
    return OK


def register_validate(sub: Any) -> None:
    v = _sub(sub, "validate", "check traces against the format and limits without running them",
             cmd_validate)
    v.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files, or directories standing for their *.json")


def _require_prover() -> None:
    for module, dist in (("z3", "z3-solver"), ("hypothesis", "hypothesis")):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"the proofs need {dist}, which is not installed",
                             f"pip install {dist} (or ./scripts/bootstrap.sh), or --no-prove")


def cmd_prove(args: argparse.Namespace) -> int:
    _require_prover()
    if args.export is not None and not Path(args.export).is_dir():
        raise UsageError(f"--export: {args.export} is not a directory", "create it first")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: {args.jobs} is not a number of processes", "--jobs 2")
    from tailproof.conformance.cli.prove import main as prove_main

    argv = (["--json"] if args.json else []) + (["--quick"] if args.quick else [])
    argv += ["--export", str(args.export)] if args.export is not None else []
    argv += ["--jobs", str(args.jobs)] if args.jobs is not None else []
    argv += ["--no-symmetry"] if args.no_symmetry else []
    return prove_main(argv)


def register_prove(sub: Any) -> None:
    pr = _sub(sub, "prove", "run the spec's lemmas, bounded checks and mutants (progress on "
              "stderr; findings about vLLM reported apart, never as failures)", cmd_prove)
    pr.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    pr.add_argument("--quick", action="store_true", help="lower bounds (a few seconds)")
    pr.add_argument("--export", default=None, metavar="DIR",
                    help="write each mutant counterexample as a conformance trace into DIR")
    pr.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                    help="worker processes for the independent checks (default: usable CPUs)")
    pr.add_argument("--no-symmetry", action="store_true",
                    help="bounded search without symmetry reduction (to compare state counts)")


def cmd_mutate(args: argparse.Namespace) -> int:
    from tailproof.conformance.cli.mutate import cmd_mutate as run_mutate

    return run_mutate(args)


def register_mutate(sub: Any) -> None:
    from tailproof.conformance.cli.mutate import add_arguments

    mu = _sub(sub, "mutate", "score the suite against mutants of vLLM 0.33's own partial-tail "
              "code (corpus plus the generators' fixed budget)", cmd_mutate)
    mu.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    add_arguments(mu)


def register_history(sub: Any) -> None:
    from tailproof.conformance.cli.history import add_arguments, cmd_history

    add_arguments(_sub(sub, "history", "list every upstream bug of the partial-tail path: its "
                       "status in vLLM 0.33, the case or finding that covers it, the mutant "
                       "that re-introduces it and whether the case kills it", cmd_history))


def cmd_doctor(args: argparse.Namespace) -> int:
    from tailproof.conformance.tools import doctor

    if args.json:
        print(json.dumps(doctor.report(), indent=2))
    else:
        print(doctor.render(doctor.collect()[1]))
    return OK


def register_doctor(sub: Any) -> None:
    d = _sub(sub, "doctor", "show the installed vLLM, torch, z3, hypothesis, Mooncake and "
             "libibverbs, and what each enables", cmd_doctor)
    d.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def cmd_stats(args: argparse.Namespace) -> int:
    from tailproof.conformance.tools import stats

    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}", "pass seconds, e.g. 5")
    url, s = stats.read_stats(args.url, args.timeout)
    print(json.dumps(s, indent=2) if args.json else stats.render(s, url))
    return OK


def register_stats(sub: Any) -> None:
    s = _sub(sub, "stats", "read a running engine's /metrics and print the connector's "
             "lookups, hit split, puts/gets, failures and pinned blocks", cmd_stats)
    s.add_argument("url", metavar="URL",
                   help="the engine's address or metrics URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--timeout", type=float, default=5.0,
                   help="seconds for the whole read: connect, headers and body (the response "
                        "is also capped at 16 MiB)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def cmd_smoke(args: argparse.Namespace) -> int:
    from tailproof.conformance.realengine import smoke

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}", "pass e.g. 80")
    cfg = smoke.parse_config(args.kv_transfer_config)
    verdict = smoke.run(cfg, max_tokens=args.max_tokens)
    print(json.dumps(verdict, indent=2) if args.json else smoke.render(verdict))
    return OK if verdict["ok"] else DIVERGED


def register_smoke(sub: Any) -> None:
    s = _sub(sub, "smoke", "check a connector configuration in vLLM's real engine on CPU: cold, "
             "warm, store-hit and after-reset passes of a tiny hybrid model must equal an "
             "engine without prefix caching (exit 1 names the failing pass)", cmd_smoke)
    s.add_argument("--kv-transfer-config", required=True, metavar="JSON",
                   help="the kv_transfer_config your engine runs (JSON, or @FILE), naming "
                        "TailproofConnector with your store and namespace")
    s.add_argument("--max-tokens", type=int, default=80,
                   help="tokens generated per prompt (80 crosses a 64-token Mamba block)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")


#: one entry per subcommand, in --help order (a new subcommand adds one register_* here)
SUBCOMMANDS: list[Callable[[Any], None]] = [
    register_check, register_replay, register_validate, register_record, register_capture,
    register_shrink, register_prove, register_mutate, register_history, register_doctor,
    register_stats, register_smoke,
]


# --- parser ---------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 through the CLI's contract."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}", f"see {self.prog} --help")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (a flag's as "off"; an unset value's where the help does
    not already say what unset means); keeps the descriptions' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS \
                or "default" in text or action.nargs == 0 and action.const is None:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        if action.default is None:
            return text if "unset:" in text else f"{text} (default: none)"
        return f"{text} (default: {action.default})"


def _sub(sub: Any, name: str, summary: str, func: Callable[[argparse.Namespace], int]) -> Any:
    p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                       formatter_class=_Formatter)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the Python traceback of an error (default: off)")
    p.set_defaults(func=func)
    return p


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON document on stdout (all text goes to stderr); "
                        "schema: conformance/schema/report.schema.json")
    p.add_argument("--junit", default=None, metavar="FILE",
                   help="also write the results as JUnit XML to FILE")


def _check_junit(args: argparse.Namespace) -> None:
    if args.junit:
        parent = Path(args.junit).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--junit: directory {parent} does not exist", "create it first")


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", choices=["memory", "mooncake"], default=None,
                   help="store behind the impl adapter (unset: memory)")
    p.add_argument("--mooncake-master", metavar="HOST:PORT", default=None,
                   help="an existing mooncake_master (unset: start one on 127.0.0.1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="device of the impl adapter's KV tensors (unset: cuda if available)")


def build_parser() -> Parser:
    p = Parser(prog="tailproof", description=__doc__, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"tailproof {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           parser_class=Parser)
    for register in SUBCOMMANDS:
        register(sub)
    return p


# --- entry ----------------------------------------------------------------------------------


def _error_line(e: BaseException) -> tuple[str, str | None]:
    """Cause and fix of an error that reaches main."""
    if isinstance(e, UsageError):
        return e.cause, e.fix
    if isinstance(e, TraceError):
        return str(e), "correct the trace (docs/trace-format.md)"
    if isinstance(e, AdapterUnavailable):
        return f"adapter not available: {e}", "./scripts/bootstrap.sh"
    from tailproof.conformance.harness.environment import classify

    return classify(e)


def main(argv: list[str] | None = None) -> int:
    """Console entry (``tailproof``): run one subcommand under the exit-code contract."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print("tailproof: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else OK
    except Exception as e:  # noqa: BLE001 - the contract: one line, never a traceback
        if debug:
            raise
        cause, fix = _error_line(e)
        if fix is None:  # not a user error: a bug in tailproof
            print(f"tailproof: internal error: {cause} (a bug in tailproof; rerun with --debug "
                  "for the traceback and report it)", file=sys.stderr)
            return INTERNAL
        print(f"tailproof: {UsageError(cause, fix).line()}", file=sys.stderr)
        return USAGE


if __name__ == "__main__":
    raise SystemExit(main())
