"""pytest-benchmark: how long the Mooncake store's fail-closed answers take against a REAL
master that dies, freezes or is not there, against the bound each promises.

The tests (tests/impl/stores/test_mooncake_faults.py) check what produces each bound without a
clock; the seconds belong here. Run:

    .venv/bin/python -m pytest benchmarks/test_store_fault_bounds.py --benchmark-only

One round each (a fault cannot be repeated on the same client); ``extra_info`` has the bound.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tailproof.impl.stores import Status, StoreError, make_store

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
MIB = 1 << 20
FIRST_CALL_BOUND_S = 7.0  # the client's own reconnect wait is ~4.5 s; nothing else may add to it
FROZEN_BOUND_S = 3.0  # rpc_timeout_ms=1000 per RPC, a put makes two
SETUP_BOUND_S = 10.0  # setup_retries=1: ~4.4 s instead of ~90 s


def _config(address: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"backend": "mooncake", "master_address": address,
                           "global_segment_size": 64 * MIB, "local_buffer_size": 16 * MIB,
                           "rpc_timeout_ms": 1500, "setup_retries": 1}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def master() -> Iterator[Any]:
    from tailproof.conformance.harness.local_master import LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with LocalMaster() as m:
        yield m


def _once(benchmark: Any, fn: Any, bound: float) -> Any:
    """Time one call of ``fn``; record and check it against ``bound``."""
    out = benchmark.pedantic(fn, rounds=1, iterations=1)
    secs = benchmark.stats.stats.max
    benchmark.extra_info.update(seconds=round(secs, 3), bound_s=bound)
    assert secs < bound
    return out


def test_first_call_after_the_master_died(benchmark: Any, master: Any) -> None:
    with make_store(_config(master.address)) as s:
        v = np.ones(64 * 1024, np.uint8)
        assert s.put("k", v).ok
        master.kill()
        out = _once(benchmark, lambda: s.get_batch(["k"], [np.zeros_like(v)]),
                    FIRST_CALL_BOUND_S)
        assert out[0].status in (Status.ERROR, Status.TIMEOUT, Status.MISS, Status.OK)


def test_put_against_a_frozen_master(benchmark: Any, master: Any) -> None:
    with make_store(_config(master.address, rpc_timeout_ms=1000)) as s:
        v = np.ones(4096, np.uint8)
        assert s.put("k", v).ok
        master.signal(signal.SIGSTOP)
        try:
            out = _once(benchmark, lambda: s.put("k2", v), FROZEN_BOUND_S)
            assert out.status in (Status.TIMEOUT, Status.ERROR)
        finally:
            master.signal(signal.SIGCONT)


def test_setup_without_a_master(benchmark: Any, master: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def setup() -> str:
        try:
            make_store(_config(f"127.0.0.1:{port}"))
        except StoreError as e:
            return str(e)
        return "no error"

    assert "mooncake setup failed" in _once(benchmark, setup, SETUP_BOUND_S)


def test_close_after_the_master_died(benchmark: Any, master: Any) -> None:
    from tailproof.impl.stores.mooncake import CLOSE_BOUND_S

    s = make_store(_config(master.address))
    assert s.put("k", np.ones(64 * 1024, np.uint8)).ok
    master.kill()
    _once(benchmark, s.close, CLOSE_BOUND_S + 1.5)
