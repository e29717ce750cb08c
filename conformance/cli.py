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
    from tailproof.conformance.show import check_expect_keys, format_show, parse_range

    for r in results:
        check_expect_keys(r)
    summary = _summary(results, time.perf_counter() - t0)
    if args.show:
        for r in results:
            print(format_show(r, parse_range(args.ops, len(r.trace.ops))))
            print()
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
    """Fill each op's ``expect`` from one adapter's observations (for authoring cases);
    written to ``-o FILE``, to stdout, or back into the trace with ``--in-place``."""
    if args.output and args.in_place:
        raise TraceError("-o/--output: give either -o FILE or --in-place, not both")
    if len(args.traces) > 1 and not args.in_place:
        raise TraceError("traces: several traces need --in-place (-o and stdout take one)")
    for path in args.traces:
        trace = load_trace(path)
        result = run_trace(trace, [args.adapter], strict=True)
        obs = result.observations[args.adapter]
        doc = trace.raw
        for op_doc, o in zip(doc["ops"], obs, strict=True):
            if o is not None and (args.overwrite or "expect" not in op_doc):
                op_doc["expect"] = o
        text = json.dumps(doc, indent=1) + "\n"
        n = sum(o is not None for o in obs)
        out = path if args.in_place else args.output
        if out is None:
            sys.stdout.write(text)
            print(f"recorded {n} observations of {path}", file=sys.stderr)
        else:
            Path(out).write_text(text)
            print(f"recorded {n} observations into {out}", file=sys.stderr)
    return 0


def cmd_capture(args: argparse.Namespace) -> int:
    """Run a named workload on vLLM's real Scheduler (CPU) with the recorder attached."""
    from tailproof.conformance.capture.run import CaptureError, capture

    try:
        res = capture(args.workload, args.output, seed=args.seed, connector=args.connector,
                      geometry=args.geometry, redact=args.redact, max_bytes=args.max_bytes)
    except CaptureError as e:
        raise TraceError(str(e)) from None
    extra = (f"; unmodelled calls: {res.unmodelled}" if res.unmodelled else "")
    print(f"captured {args.workload}: {res.ops} ops, {res.steps} engine steps -> "
          f"{res.path}{extra}", file=sys.stderr)
    return 0


def cmd_shrink(args: argparse.Namespace) -> int:
    """Delta-debug a diverging trace down to a small one with the same divergence."""
    from tailproof.conformance.capture.writer import write_trace
    from tailproof.conformance.shrink import shrink

    adapters = _parse_adapters(args.against)
    trace = load_trace(args.trace)
    res = shrink(trace, adapters, args.strict_ids,
                 log=lambda m: print(f"  {m}", file=sys.stderr))
    adapter, against, op, field = res.signature
    print(f"shrunk {trace.source}: {res.ops_before} ops -> {res.ops_after} ops "
          f"({res.runs} replays); divergence kept: {adapter} vs {against} on {op}.{field}",
          file=sys.stderr)
    if args.output:
        write_trace(res.doc, args.output)
    else:
        sys.stdout.write(json.dumps(res.doc, indent=1) + "\n")
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
    if args.json:
        print(json.dumps(summary, indent=2))
    return rc


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", choices=["memory", "mooncake"],
                   help="store behind the impl adapter (default: memory, or $TAILPROOF_STORE)")
    p.add_argument("--mooncake-master", metavar="HOST:PORT",
                   help="an existing mooncake_master (default: start one on 127.0.0.1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailproof", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run the corpus on every installed adapter, then prove")
    c.add_argument("--adapters", help="comma-separated subset of adapters")
    c.add_argument("--no-prove", action="store_true", help="skip the spec's proofs")
    c.add_argument("--json", action="store_true")
    _store_args(c)
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("replay", help="replay traces on adapters and compare observations")
    r.add_argument("traces", nargs="+")
    r.add_argument("--against", default="reference,vllm")
    r.add_argument("--strict-ids", action="store_true", help="compare block ids exactly")
    r.add_argument("--json", action="store_true")
    r.add_argument("--show", action="store_true",
                   help="print every op with each adapter's observation side by side")
    r.add_argument("--ops", metavar="A:B", help="with --show: only ops A..B-1")
    _store_args(r)
    r.set_defaults(func=cmd_replay)
    rec = sub.add_parser("record", help="write one adapter's observations as expectations")
    rec.add_argument("traces", nargs="+")
    rec.add_argument("--adapter", default="vllm")
    rec.add_argument("--overwrite", action="store_true")
    rec.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    rec.add_argument("--in-place", action="store_true", help="rewrite each trace file")
    rec.set_defaults(func=cmd_record)
    cap = sub.add_parser("capture", help="record a named workload on vLLM's real Scheduler")
    cap.add_argument("--workload", required=True, help="chat, agent, preemption, aborts, "
                     "max_tokens_1, resend, mixed")
    cap.add_argument("-o", "--output", required=True, metavar="FILE")
    cap.add_argument("--seed", type=int, default=0)
    cap.add_argument("--connector", default="none", help="none (the only one recorded yet)")
    cap.add_argument("--geometry", help="block geometry: fa16-m16-h4 (default), fa8-m16-h4, "
                     "fa16-m32-h8, fa16-m64-h16")
    cap.add_argument("--redact", action="store_true", help="canonical token ids")
    cap.add_argument("--max-bytes", type=int, help="rotate into segments past N bytes")
    cap.set_defaults(func=cmd_capture)
    sh = sub.add_parser("shrink", help="shrink a diverging trace, keeping its divergence")
    sh.add_argument("trace")
    sh.add_argument("--against", default="reference,vllm")
    sh.add_argument("--strict-ids", action="store_true")
    sh.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    sh.set_defaults(func=cmd_shrink)
    v = sub.add_parser("validate", help="validate traces without running them")
    v.add_argument("traces", nargs="+")
    v.set_defaults(func=cmd_validate)
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
