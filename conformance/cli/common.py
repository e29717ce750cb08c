"""What the commands share: reading traces, choosing adapters, running the corpus on
them, printing divergences and the report, and the options several commands take."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tailproof.conformance.format.trace import Trace, TraceError, load_trace
from tailproof.conformance.harness import netns, report, vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS, available
from tailproof.conformance.harness.errors import DIVERGED, OK, UsageError
from tailproof.conformance.harness.replay import (
    CaseResult,
    format_divergence,
    run_trace,
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
    if netns.loopback_only():  # already in a namespace with only lo: nothing else to reach them
        return
    print("tailproof: warning: --mooncake-master: this run's Mooncake clients listen on all "
          "interfaces (Mooncake binds them to the wildcard address; only a run that starts "
          "its own master moves into a private network namespace): use it on a trusted "
          "network, or leave --mooncake-master unset", file=sys.stderr)


def _isolate_network() -> None:
    """Mooncake clients listen on every interface whatever they are told: a run that starts
    its own master moves into a private loopback-only network namespace first (root only)."""
    why = netns.enter_loopback_namespace()
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
    # deferred: the impl adapter imports torch and vLLM (seconds), needed only with --store
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
            # deferred: tailproof.impl.stores imports numpy (a tenth of a second at every start)
            from tailproof.conformance.harness.local_master import LocalMaster

            _isolate_network()
            stack.enter_context(_signals_unwind())
            # Its stop is registered before it starts: a signal between the start and the
            # registration would otherwise leave the master running after the CLI.
            master = LocalMaster()
            stack.push(master)
            address = master.start().address
        options["store_config"] = {"master_address": address}
    stack.callback(impl_adapter.close_shared_stores)
    return {"impl": options}


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


def _refusal_label(why: str) -> str:
    """``config.connector.X is on: ...`` -> ``X (not in vLLM)``; ``config.vllm is 0.33:
    ...`` -> ``vllm 0.33 (another release)``; other reasons whole."""
    if why.startswith("config.vllm is "):
        return f"vllm {why.split(' is ', 1)[1].split(':', 1)[0]} (another release)"
    if why.startswith("config.") and " is " in why:
        key = why.split(" is ", 1)[0].rsplit(".", 1)[-1]
        return f"{key} (not in vLLM)" if "not in vLLM" in why else key
    return why


def _print_refusals(results: list[CaseResult], out: TextIO) -> None:
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


def _vllm_line(info: vllm_compat.VllmInfo) -> str:
    if info.version is None:
        return "vLLM not installed"
    return f"vLLM {info.version} ({info.source})"


def _conformance(args: argparse.Namespace, traces: list[Trace], adapters: list[str],
                 strict: bool, progress: bool) -> tuple[list[CaseResult], float]:
    t0 = time.perf_counter()
    why = vllm_compat.token_id_refusal(traces, adapters)
    if why is not None:
        raise UsageError(why, "use smaller token ids, or run the reference adapter only "
                              "(--adapters reference / --against reference)")
    with contextlib.ExitStack() as stack:
        options = _impl_options(args, adapters, stack)
        results = run_all(traces, adapters, strict, progress, options)
    return results, time.perf_counter() - t0


def _finish(args: argparse.Namespace, command: str, info: vllm_compat.VllmInfo,
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


def _history_findings(results: list[CaseResult], out: TextIO,
                      static: bool) -> list[dict[str, Any]]:
    """The open upstream bugs the replayed cases (and, for ``check``, the installed vLLM)
    exhibit: findings, never failures (``conformance/tools/history/findings.py``)."""
    found = history.trace_findings(results) + (history.static_findings() if static else [])
    history.print_findings(found, out)
    return found


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
