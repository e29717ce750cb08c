"""Mooncake store against a REAL master that dies, freezes, restarts or is shared by processes.

Every check is fail-closed: a call may answer MISS/ERROR/TIMEOUT, never OK with wrong bytes.
The bounds are checked here by what produces them, not by a clock: the client is handed
``rpc_timeout_ms`` and ``setup_retries``; once the breaker trips no call reaches the client; a
close with the master gone parks the native close. How long each takes (~4.5 s for the first
call after a crash, rpc_timeout_ms, ~4.4 s setup, CLOSE_BOUND_S) is measured, against those
bounds, by benchmarks/test_store_fault_bounds.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from storetest_helpers import MIB, mooncake_config, pattern, wait_until

from tailproof.conformance.harness.local_master import LocalMaster
from tailproof.impl.stores import Status, Store, StoreError, make_store

Factory = Callable[..., LocalMaster]  # the mooncake_master_factory fixture
FAILED = {Status.ERROR, Status.TIMEOUT, Status.MISS}


class NativeCalls:
    """Wraps a store's native client and records the methods the test's thread calls on it
    (the guard's background probe is not counted)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._thread = threading.get_ident()
        self.names: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.names.append(name)
            return attr(*a, **k)
        return call


def native(store: Store) -> NativeCalls:
    """Count ``store``'s calls into its Mooncake client from here on."""
    calls = NativeCalls(store._client)
    store._client = calls
    return calls


def test_master_killed_mid_run_fails_closed_in_bounded_time(
        mooncake_master_factory: Factory) -> None:
    master = mooncake_master_factory()
    with make_store(mooncake_config(master.address)) as s:
        vals = [pattern(i, 64 * 1024) for i in range(4)]
        keys = [f"k{i}" for i in range(4)]
        assert all(o.ok for o in s.put_batch(keys, vals))
        master.kill()
        bufs = [np.zeros_like(v) for v in vals]
        got = s.get_batch(keys, bufs)
        for o, b, v in zip(got, bufs, vals, strict=True):
            assert o.status in FAILED or np.array_equal(b, v)
        for call in (lambda: s.get_batch(keys, bufs), lambda: s.put_batch(["n"], [vals[0]])):
            assert all(o.status in FAILED for o in call())
        # Once the client has noticed (health_check), every call fails closed at once: the
        # breaker is tripped and no call reaches the client.
        assert wait_until(lambda: (s.exists(keys), s._guard.down_reason)[1] is not None, 30.0)
        calls = native(s)
        assert s.exists(keys) == [False] * 4
        assert s.put("late", vals[0]).status is Status.ERROR
        assert calls.names == []


def test_master_restart_loses_data_without_crash(mooncake_master_factory: Factory) -> None:
    master = mooncake_master_factory()
    with make_store(mooncake_config(master.address)) as s:
        v = pattern(1, 4096)
        assert s.put("old", v).ok
        master.kill()
        master.start()  # same ports: the client reconnects and re-mounts its segment
        assert wait_until(lambda: s.put("probe", v).saved, 10.0), master.log_tail()
        buf = np.zeros(4096, np.uint8)
        assert s.get("old", buf).status is Status.MISS
        assert s.exists(["old"]) == [False]
        assert s.put("new", v).ok and s.get("new", buf).ok
        np.testing.assert_array_equal(buf, v)


def test_frozen_master_times_out_within_rpc_timeout(mooncake_master_factory: Factory) -> None:
    master = mooncake_master_factory()
    with make_store(mooncake_config(master.address, rpc_timeout_ms=1000)) as s:
        v = pattern(2, 4096)
        assert s.put("k", v).ok
        # The client bounds each master RPC by the configured timeout (read at its setup).
        assert os.environ["MC_RPC_TIMEOUT_MS"] == os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] == "1000"
        master.signal(signal.SIGSTOP)
        try:
            assert s.put("k2", v).status in (Status.TIMEOUT, Status.ERROR)
            assert s.get("k", np.zeros(4096, np.uint8)).status in FAILED
        finally:
            master.signal(signal.SIGCONT)
        buf = np.zeros(4096, np.uint8)
        assert wait_until(lambda: s.get("k", buf).ok, 5.0)  # data survives a freeze
        np.testing.assert_array_equal(buf, v)



CHILD = textwrap.dedent("""
    import sys, numpy as np
    from tailproof.impl.stores import make_store
    master, key, n, new_key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with make_store({"backend": "mooncake", "master_address": master, "global_segment_size": 0,
                     "rpc_timeout_ms": 1500}) as s:
        buf = np.zeros(n, np.uint8)
        out = s.get(key, buf)
        print(out.status.value, int(buf.astype(np.int64).sum()))
        # A pure client's put lands in the parent's segment and outlives this process.
        val = np.arange(n, dtype=np.uint32).astype(np.uint8)
        print(s.put(new_key, val).status.value)
""")


def test_second_process_reads_and_writes_the_same_pool(mooncake_session_store: Store,
                                                       mooncake_master: str) -> None:
    s = mooncake_session_store
    v = pattern(5, 256 * 1024)
    assert s.put("shared", v).ok
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-c", CHILD, mooncake_master, "shared", str(v.size),
                           "from-child"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[:2] == ["ok", str(int(v.astype(np.int64).sum()))]
    assert lines[2] == "ok"
    buf = np.zeros(v.size, np.uint8)
    assert s.get("from-child", buf).ok
    np.testing.assert_array_equal(buf, np.arange(v.size, dtype=np.uint32).astype(np.uint8))
    s.remove_all()


def test_store_full_then_eviction_frees_space(mooncake_master_factory: Factory) -> None:
    """Mooncake evicts unleased values asynchronously: after STORE_FULL, puts succeed again."""
    master = mooncake_master_factory()
    with make_store(mooncake_config(master.address, global_segment_size=16 * MIB)) as s:
        v = pattern(3, MIB)
        res = s.put_batch([f"a{i}" for i in range(24)], [v] * 24)
        assert any(o.status is Status.STORE_FULL for o in res)
        fresh = itertools.count()
        assert wait_until(lambda: s.put(f"b{next(fresh)}", v).ok, 30.0)


def test_setup_without_master_fails_fast_with_clear_error(mooncake_available: None) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StoreError, match=f"mooncake setup failed.*127.0.0.1:{port}"):
        make_store(mooncake_config(f"127.0.0.1:{port}"))
    # setup_retries=1 reached the client: one attempt (~4.4 s) instead of its default (~90 s).
    assert os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] == "1"


def test_close_after_the_master_died_is_bounded(mooncake_master_factory: Factory) -> None:
    """The client's own close retries unmounting from a dead master for 2-20 s holding the GIL;
    the store's close returns within its bound and parks the native close until exit."""
    from tailproof.impl.stores.mooncake import _PARKED_CLIENTS

    for touched in (False, True):  # with and without a call that noticed the dead master
        master = mooncake_master_factory()
        s = make_store(mooncake_config(master.address))
        assert s.put("k", pattern(0, 64 * 1024)).ok
        master.kill()
        if touched:
            s.exists(["k"])
        parked = len(_PARKED_CLIENTS)
        calls = native(s)
        s.close()
        # The native close (2-20 s holding the GIL) was not called: it is parked until exit.
        assert "close" not in calls.names and len(_PARKED_CLIENTS) == parked + 1, touched
        assert s.exists(["k"]) == [False]  # closed: answers, never crashes
