"""``tailproof replay --against reference,impl --store mooncake`` runs the whole corpus on a
real Mooncake master (started for the run and stopped by PID) with 0 divergences; a SIGTERM or
SIGINT to the CLI stops that master too."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from proc_tree import alive, children  # noqa: E402

from tailproof.conformance.cli.main import main
from tailproof.conformance.harness.corpus import corpus_paths

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm]


def _master_pids() -> set[int]:
    """Live mooncake_master processes that this test process started (other suites on the same
    machine run masters of their own)."""
    pids = set()
    for pid in children(os.getpid()):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("mooncake_maste"):
                if alive(pid):
                    pids.add(pid)
        except OSError:
            continue
    return pids


def test_whole_corpus_on_a_real_mooncake_started_by_the_cli(
        mooncake_master: str, capsys: pytest.CaptureFixture[str]) -> None:
    # mooncake_master proves the package and libibverbs are usable here (else it skips).
    before = _master_pids()
    rc = main(["replay", *map(str, corpus_paths()), "--against", "reference,impl",
               "--store", "mooncake", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert rc == 0 and out["cases"] == len(corpus_paths())
    assert _master_pids() == before  # the CLI stopped the master it started


def test_memory_store_and_given_master(mooncake_master: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    conn = [str(p) for p in corpus_paths() if p.name.startswith("conn_")]
    for extra in (["--store", "memory"], ["--store", "mooncake", "--mooncake-master",
                                          mooncake_master]):
        rc = main(["replay", *conn, "--against", "reference,impl", "--json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert (rc, out["divergences"]) == (0, []), extra


# The real CLI, whose LocalMaster writes its PID to the pipe ``TP_MASTER_FD`` once it accepts:
# the test signals the CLI exactly when the master is up, instead of polling the process tree.
ANNOUNCING_CLI = textwrap.dedent("""
    import os, sys
    from tailproof.conformance.harness import local_master
    from tailproof.conformance.cli.main import main

    start = local_master.LocalMaster.start

    def announced(self, *args, **kwargs):
        out = start(self, *args, **kwargs)
        os.write(int(os.environ["TP_MASTER_FD"]), f"{self.pid}\\n".encode())
        return out

    local_master.LocalMaster.start = announced
    sys.exit(main(sys.argv[1:]))
""")
LIVENESS_S = 120  # the CLI must start its master by then (only fails the test, never paces)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_cli_stops_the_master_it_started(mooncake_master: str,
                                                       sig: signal.Signals) -> None:
    conn = [str(p) for p in corpus_paths() if p.name.startswith("conn_")] * 50  # minutes of work
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", ANNOUNCING_CLI, "replay", *conn,
         "--against", "reference,impl", "--store", "mooncake"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        pass_fds=(w,), env={**os.environ, "TP_MASTER_FD": str(w)},
        # A runner started from a backgrounded shell has SIGINT ignored, and Python keeps an
        # inherited SIG_IGN (no KeyboardInterrupt): give the CLI the disposition a terminal
        # user's Ctrl-C meets.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], LIVENESS_S)
        assert ready, "the CLI started no master"
        line = os.read(r, 64).decode()
        assert line.endswith("\n"), proc.stderr.read().decode()[-2000:]
        master = int(line)
        assert master in children(proc.pid)
        assert Path(f"/proc/{master}/comm").read_text().startswith("mooncake_maste")
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        # interrupted, not a clean run (the CLI's stderr says how it ended, if it did not)
        assert rc != 0, proc.stderr.read().decode()[-2000:]
        assert not alive(master), "mooncake_master outlived the CLI"
    finally:
        os.close(r)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
