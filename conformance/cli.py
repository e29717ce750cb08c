"""The ``tailproof`` command: ``check`` (the main job), ``replay``, ``record``, ``validate``,
``prove``. Exit status: 0 clean, 1 a divergence or failed proof, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tailproof.conformance.adapters import ADAPTERS, AdapterUnavailable, available
from tailproof.conformance.replay import CaseResult, format_divergence, run_trace
from tailproof.conformance.trace import Trace, TraceError, load_trace

CASES_DIR = Path(__file__).resolve().parent / "cases"


def corpus_paths() -> list[Path]:
    """Every case of the shipped corpus, in name order."""
    return sorted(CASES_DIR.glob("*.json"))


def _load_all(paths: list[str | Path]) -> list[Trace]:
    """Validate every trace before running any (a bad one stops the run with status 2)."""
    return [load_trace(p) for p in paths]


def _progress(i: int, n: int, label: str) -> None:
    if not sys.stderr.isatty() and os.environ.get("TAILPROOF_PROGRESS") != "1":
        if i == n:
            print(f"  {n}/{n} cases", file=sys.stderr)
        return
    width = 30
    done = width * i // max(n, 1)
    print(f"\r  [{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:40]:<40}",
          end="" if i < n else "\n", file=sys.stderr, flush=True)


def _run(traces: list[Trace], adapters: list[str], strict: bool,
         progress: bool) -> list[CaseResult]:
    results = []
    for i, t in enumerate(traces):
        if progress:
            _progress(i, len(traces), t.name)
        results.append(run_trace(t, adapters, strict))
    if progress:
        _progress(len(traces), len(traces), "")
    return results


def _summary(results: list[CaseResult], seconds: float) -> dict[str, Any]:
    skipped: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        for a, names in r.skipped().items():
            skipped.setdefault(a, {})[r.name] = names
    return {
        "cases": len(results),
        "ops": sum(len(r.trace.ops) for r in results),
        "divergences": [d.as_json() for r in results for d in r.divergences],
        "skipped_ops": skipped,
        "seconds": round(seconds, 3),
    }


def _parse_adapters(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    for a in names:
        if a not in ADAPTERS:
            raise TraceError(f"--against: unknown adapter {a!r} (known: {', '.join(ADAPTERS)})")
    return names


def _impl_store(args: argparse.Namespace, adapters: list[str]) -> contextlib.ExitStack:
    """Point the impl adapter at the chosen store; for ``--store mooncake`` without a master
    address, start a ``mooncake_master`` on 127.0.0.1 for the run and stop it by PID after."""
    stack = contextlib.ExitStack()
    if "impl" not in adapters or args.store is None:
        return stack
    from tailproof.conformance.adapters import impl as impl_adapter

    store_config: dict[str, Any] = {}
    if args.store == "mooncake":
        address = args.mooncake_master
        if not address:
            from tailproof.impl.stores.local_master import LocalMaster

            address = stack.enter_context(LocalMaster()).address
        store_config = {"master_address": address}
    saved = dict(impl_adapter.ImplConnector.options)
    impl_adapter.ImplConnector.options = {"store": args.store, "store_config": store_config}
    stack.callback(setattr, impl_adapter.ImplConnector, "options", saved)
    stack.callback(impl_adapter.close_shared_stores)
    return stack


def cmd_replay(args: argparse.Namespace) -> int:
    adapters = _parse_adapters(args.against)
    traces = _load_all(args.traces)
    t0 = time.perf_counter()
    with _impl_store(args, adapters):
        results = _run(traces, adapters, args.strict_ids, progress=False)
    summary = _summary(results, time.perf_counter() - t0)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for r in results:
            for d in r.divergences:
                print(format_divergence(r, d))
                print()
        print(f"{summary['cases']} cases, {summary['ops']} ops, "
              f"{len(summary['divergences'])} divergences, {summary['seconds']:.1f}s "
              f"({', '.join(adapters)}{', strict ids' if args.strict_ids else ''})")
    return 1 if summary["divergences"] else 0


def cmd_record(args: argparse.Namespace) -> int:
    """Fill each op's ``expect`` from one adapter's observations (for authoring cases)."""
    for path in args.traces:
        trace = load_trace(path)
        result = run_trace(trace, [args.adapter], strict=True)
        obs = result.observations[args.adapter]
        doc = trace.raw
        for op_doc, o in zip(doc["ops"], obs, strict=True):
            if o is not None and (args.overwrite or "expect" not in op_doc):
                op_doc["expect"] = o
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"recorded {sum(o is not None for o in obs)} observations into {path}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    for t in _load_all(args.traces):
        print(f"ok {t.source}: {len(t.ops)} ops")
    return 0


def _prove(argv: list[str]) -> int | None:
    try:
        from tailproof.spec.prove import main as prove_main
    except ImportError:
        return None
    return prove_main(argv)


def cmd_prove(args: argparse.Namespace) -> int:
    rc = _prove(args.rest)
    if rc is None:
        print("tailproof prove: the spec's prover (tailproof.spec.prove) is not installed",
              file=sys.stderr)
        return 2
    return rc


def cmd_check(args: argparse.Namespace) -> int:
    """The main job: the whole corpus on every installed adapter, then the proofs."""
    wanted = _parse_adapters(args.adapters) if args.adapters else list(ADAPTERS)
    adapters = [a for a in wanted if available(a)]
    missing = [a for a in wanted if a not in adapters]
    traces = _load_all(corpus_paths())
    print(f"tailproof check: {len(traces)} cases on {', '.join(adapters)}"
          + (f" (not installed: {', '.join(missing)})" if missing else ""), file=sys.stderr)
    t0 = time.perf_counter()
    with _impl_store(args, adapters):
        results = _run(traces, adapters, strict=False, progress=True)
    summary = _summary(results, time.perf_counter() - t0)
    for r in results:
        for d in r.divergences[:1]:
            print(format_divergence(r, d))
            print()
    print(f"conformance: {summary['cases']} cases, {summary['ops']} ops, "
          f"{len(summary['divergences'])} divergences, {summary['seconds']:.1f}s")
    rc = 1 if summary["divergences"] else 0
    if not args.no_prove:
        prc = _prove(["--json"] if args.json else [])
        if prc is None:
            print("proofs: skipped (tailproof.spec.prove not installed)")
        rc = max(rc, prc or 0)
    if args.mutate:
        rc = max(rc, _check_mutation(summary, args.json))
    if args.json:
        print(json.dumps(summary, indent=2))
    return rc


def _check_mutation(summary: dict[str, Any], as_json: bool) -> int:
    """``check --mutate``: the full mutant catalog with the default budget; its score joins
    the summary under ``mutation``."""
    from tailproof.conformance.mutate.cli import run_from_args
    from tailproof.conformance.mutate.run import format_report

    p = argparse.ArgumentParser()
    _mutate_args(p)
    opts = p.parse_args([])
    report = run_from_args(opts)
    summary["mutation"] = report.as_json()
    if not as_json:
        print(format_report(report))
    return 0 if report.score >= opts.min_score else 1


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", choices=["memory", "mooncake"],
                   help="store behind the impl adapter (default: memory, or $TAILPROOF_STORE)")
    p.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="an existing mooncake_master (default: start one on 127.0.0.1)")


def _mutate_args(p: argparse.ArgumentParser) -> None:
    from tailproof.conformance.mutate.cli import add_arguments

    add_arguments(p)


def _cmd_mutate(args: argparse.Namespace) -> int:
    from tailproof.conformance.mutate.cli import cmd_mutate

    return cmd_mutate(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailproof", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run the corpus on every installed adapter, then prove")
    c.add_argument("--adapters", help="comma-separated subset of adapters")
    c.add_argument("--no-prove", action="store_true", help="skip the spec's proofs")
    c.add_argument("--json", action="store_true")
    c.add_argument("--mutate", action="store_true",
                   help="also score the suite against the vLLM mutant catalog (slow)")
    _store_args(c)
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("replay", help="replay traces on adapters and compare observations")
    r.add_argument("traces", nargs="+")
    r.add_argument("--against", default="reference,vllm")
    r.add_argument("--strict-ids", action="store_true", help="compare block ids exactly")
    r.add_argument("--json", action="store_true")
    _store_args(r)
    r.set_defaults(func=cmd_replay)
    rec = sub.add_parser("record", help="write one adapter's observations as expectations")
    rec.add_argument("traces", nargs="+")
    rec.add_argument("--adapter", default="vllm")
    rec.add_argument("--overwrite", action="store_true")
    rec.set_defaults(func=cmd_record)
    v = sub.add_parser("validate", help="validate traces without running them")
    v.add_argument("traces", nargs="+")
    v.set_defaults(func=cmd_validate)
    mu = sub.add_parser("mutate", help="score the suite against mutants of vLLM's own code")
    mu.add_argument("--json", action="store_true")
    _mutate_args(mu)
    mu.set_defaults(func=_cmd_mutate)
    pr = sub.add_parser("prove", help="run the spec's lemmas, bounded check and mutants")
    pr.add_argument("rest", nargs=argparse.REMAINDER)
    pr.set_defaults(func=cmd_prove)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["prove"]:  # the prover parses its own options (--json, --quick, ...)
        rest = argv[1:]
        return cmd_prove(argparse.Namespace(rest=rest[1:] if rest[:1] == ["--"] else rest))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TraceError as e:
        print(f"tailproof: {e}", file=sys.stderr)
        return 2
    except AdapterUnavailable as e:
        print(f"tailproof: adapter not available: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
