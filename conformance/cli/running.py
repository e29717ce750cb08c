"""Running traces on adapters: which adapters can run here, the impl adapter's options (a
Mooncake master started for the run, in a private network namespace), the corpus run with
its progress line."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from tailproof.conformance.format.trace import Trace
from tailproof.conformance.harness import netns, vllm_compat
from tailproof.conformance.harness.adapters import available
from tailproof.conformance.harness.errors import UsageError
from tailproof.conformance.harness.replay import (
    CaseResult,
    run_trace,
)


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
                             "without it (--adapters reference)")
    if not run:
        raise UsageError(f"no adapter can run here ({'; '.join(not_run.values())})",
                         "./scripts/bootstrap.sh")
    return run, not_run


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
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


def impl_options(args: argparse.Namespace, adapters: list[str],
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
            stack.enter_context(signals_unwind())
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


def run_conformance(args: argparse.Namespace, traces: list[Trace], adapters: list[str],
                    strict: bool, progress: bool) -> tuple[list[CaseResult], float]:
    t0 = time.perf_counter()
    why = vllm_compat.token_id_refusal(traces, adapters)
    if why is not None:
        raise UsageError(why, "use smaller token ids, or run the reference adapter only "
                              "(--adapters reference)")
    with contextlib.ExitStack() as stack:
        options = impl_options(args, adapters, stack)
        results = run_all(traces, adapters, strict, progress, options)
    return results, time.perf_counter() - t0
