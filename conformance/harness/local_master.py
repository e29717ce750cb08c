"""Run a ``mooncake_master`` on 127.0.0.1 for the harness, tests and benchmarks.

Why here (the harness, not ``tailproof.impl``): ``tailproof replay --store mooncake`` without
``--mooncake-master`` starts one for the run, so the launcher is needed at run time, not only by
tests; the test fixtures (tests/impl/conftest.py) and the benchmarks use it too. It starts a real
master on loopback on free ports, checks it is ready, and stops it by its own PID (never by
name). Production deployments run their master themselves.

The master's log goes to a private folder (``mkdtemp``: mode 0700, unpredictable name, removed
when the context manager exits) unless the caller names one; the file is opened with
``O_NOFOLLOW``, so a planted symlink is never followed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from tailproof.impl.stores.base import StoreError

# Read leases: a get's lease must outlive its transfer, or Mooncake answers -707 LEASE_EXPIRED
# (seen at 200 ms for a 65 MiB batch on a loaded 2-core machine); 2 s keeps tests and
# benchmarks robust while eviction of read values still follows quickly (default: 10 s).
LEASE_TTL_MS = 2000
# For real-engine tests that check a pass was served from the store: a Mooncake get fails with
# LEASE_EXPIRED when its transfer ends after the lease its query took (``Client::Get``: "lease
# expired before data transfer completed"). A rank's first read also sets up its transfer
# connection (0.8 s for 8 x 8 MiB on an idle 2-core machine, against 17 ms once set up), and
# with several engine processes on a loaded machine a read can stall past 2 s: the load then
# fails closed and is recomputed, and "served from the store" fails. 30 s, the RPC timeout
# such tests already allow a master call, bounds the slowest read they tolerate.
SLOW_READ_LEASE_TTL_MS = 30_000
CLIENT_TTL_S = 2  # a dead client's segment is dropped after 2 s (default 10)


def find_master_binary() -> str:
    """``mooncake_master`` from the installed package, else from the venv's bin or PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "mooncake_master"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("mooncake_master",
                         path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    if not found:
        raise StoreError("no mooncake_master binary (pip install "
                         "mooncake-transfer-engine-non-cuda==0.3.13.post1)")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class LocalMaster:
    """One ``mooncake_master`` bound to 127.0.0.1 (RPC and metrics), restartable on its ports.

    P2PHANDSHAKE clients need no metadata server, so none is started."""

    def __init__(self, log_dir: Path | None = None, extra_flags: tuple[str, ...] = (),
                 lease_ttl_ms: int = LEASE_TTL_MS) -> None:
        self.binary = find_master_binary()
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self._private_dir: Path | None = None
        if log_dir is None:
            log_dir = self._private_dir = Path(tempfile.mkdtemp(prefix="tailproof-mooncake-"))
        self.log_path = log_dir / f"mooncake-master-{self.rpc_port}.log"
        self.extra_flags = extra_flags
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 15.0) -> LocalMaster:
        """Spawn and wait until the RPC port accepts (about 0.05 s); StoreError on failure."""
        cmd = [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
               "--enable_http_metadata_server=false", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
               f"--client_ttl={CLIENT_TTL_S}", "--rpc_thread_num=2", "--logtostderr=1",
               *self.extra_flags]
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            while not _accepts(self.rpc_port):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise StoreError(f"mooncake_master did not start:\n{self.log_tail()}")
                time.sleep(0.02)
        except BaseException:  # also SIGTERM/Ctrl-C while waiting: no master is left behind
            self.stop()
            self.remove_private_log()
            raise
        return self

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to this master's PID (SIGSTOP freezes it, SIGCONT resumes it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """Crash the master (SIGKILL to its PID) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """Stop by PID: SIGCONT (in case frozen), SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def keys(self) -> list[str]:
        """Every key the master holds now (its HTTP ``/get_all_keys`` on the metrics port)."""
        url = f"http://127.0.0.1:{self.metrics_port}/get_all_keys"
        with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - loopback, our master
            return r.read().decode().split()

    def remove_private_log(self) -> None:
        """Delete the private log folder (only one this object created)."""
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> LocalMaster:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        self.remove_private_log()
