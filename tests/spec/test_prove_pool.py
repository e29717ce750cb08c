"""``tailproof prove`` in a process pool: the same report as one process, in the same order,
and Ctrl-C stops every worker."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest
from proc_tree import alive, children  # noqa: E402

pytest.importorskip("z3", reason="the proofs need z3-solver")


def _strip(report: dict[str, Any]) -> Any:
    """A report without what depends on timing or on the pool."""
    drop = {"seconds", "cpu_seconds", "jobs"}

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(report)


def test_pool_report_equals_one_process() -> None:
    from tailproof.spec.prove import failed, run

    seen: list[str] = []
    pooled = run(quick=True, jobs=2, progress=seen.append)
    alone = run(quick=True, jobs=1)
    assert not failed(pooled) and pooled["jobs"] == 2 and pooled["cpu_seconds"] > 0
    assert _strip(pooled) == _strip(alone)
    assert all(p.get("states", 1) > 0 for p in pooled["properties"])
    # every task reported its end, whatever order the workers finished in
    assert sum(ln.endswith("CPU)") for ln in seen) == len(seen) - 1


def test_ctrl_c_stops_the_workers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailproof.conformance.cli.main", "prove", "--jobs", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # a runner started from a backgrounded shell has SIGINT ignored (see test_cli_store)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the pool has started once this line is out
        assert "worker processes" in line, line
        # ProofRun forks both workers in ``mp.Pool(...)`` before ``results`` prints that line
        # (a forked child is in /proc once ``Process.start`` returns): no wait, no polling.
        workers = children(proc.pid)
        assert len(workers) >= 2, workers
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert rc == 130, err[-2000:]
        assert "tailproof: interrupted" in err and "Traceback" not in err, err[-2000:]
        assert not [w for w in workers if alive(w)], "a worker outlived the CLI"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
