"""CLI hardening (issue 20, item 10): ``--mooncake-master`` warns that the run's Mooncake
clients listen on every interface; ``tailproof capture`` unwinds on SIGTERM (the recorder
closes its file, the engine shuts down) instead of dying with -15."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest

import tailproof.conformance.cli.main as cli
import tailproof.conformance.cli.running as cli_running
from tailproof.conformance.harness import netns


def _options(master: str | None, store: str) -> dict:
    args = argparse.Namespace(store=store, mooncake_master=master, device="cpu")
    with contextlib.ExitStack() as stack:
        return cli_running.impl_options(args, ["reference", "impl"], stack)


def test_mooncake_master_warns_of_wildcard_listeners(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mooncake", reason="--store mooncake needs the mooncake package")
    pytest.importorskip("torch")
    monkeypatch.setattr(netns, "loopback_only", lambda: False)
    opts = _options("127.0.0.1:50051", "mooncake")
    assert opts["impl"]["store_config"] == {"master_address": "127.0.0.1:50051"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "tailproof: warning: --mooncake-master: this run's Mooncake clients listen on all "
        "interfaces")
    monkeypatch.setattr(netns, "loopback_only", lambda: True)  # a namespace with only lo
    _options("127.0.0.1:50051", "mooncake")
    _options(None, "memory")
    assert capsys.readouterr().err == ""


def test_capture_unwinds_on_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm")
    from tailproof.conformance.tools.capture_engine import engine as engine_mod
    from tailproof.conformance.tools.capture_engine import run as run_mod

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    shut: list[bool] = []
    real_shutdown = engine_mod.CaptureEngine.shutdown

    def shutdown(self: object) -> None:
        shut.append(True)
        real_shutdown(self)

    monkeypatch.setattr(engine_mod.CaptureEngine, "shutdown", shutdown)
    chat = run_mod.WORKLOADS["chat"]
    reached = threading.Event()

    def run_then_terminate(engine: object, rng: object) -> None:
        chat.run(engine, rng)  # a real workload, recorded
        reached.set()
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this (main) thread
        threading.Event().wait(60)  # only the signal ends this wait
        raise AssertionError("SIGTERM did not unwind the capture")

    monkeypatch.setitem(run_mod.WORKLOADS, "chat", replace(chat, run=run_then_terminate))
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "c.json"
    rc = cli.main(["capture", "--workload", "chat", "-o", str(out)])
    assert reached.is_set()
    assert rc == 128 + signal.SIGTERM
    assert shut == [True]  # the engine it started was shut down
    assert out.stat().st_size > 0  # the recorder closed its file on the way out
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored
    assert "Traceback" not in capsys.readouterr().err
