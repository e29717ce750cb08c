"""pytest-benchmark: how long an engine step takes while a REAL Mooncake master is frozen or
killed under the asynchronous data plane, against the bound a step must stay under.

The tests (tests/impl/test_async_mooncake_faults.py) check without a clock that no step waits
for the store (no data-plane call on the step's thread; steps complete while one is held);
the seconds belong here. Run:

    .venv/bin/python -m pytest benchmarks/test_async_fault_steps.py --benchmark-only

One round each (a fault cannot be repeated on the same master); ``extra_info`` has the
slowest scheduled step after the fault and the bound.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "impl"))

from test_async_mooncake_faults import _engine, _serve  # noqa: E402
from test_async_stress import _prompts  # noqa: E402

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # as tests/impl/conftest.py
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
STEP_BOUND_S = 1.0  # no engine step may wait for the store (a frozen call takes >= 1.5 s)


def _slowest(benchmark: Any, run: Any) -> None:
    """Run ``run`` once (it returns the step times after the fault); record and bound them."""
    after = benchmark.pedantic(run, rounds=1, iterations=1)
    assert after, "no scheduled step after the fault"
    benchmark.extra_info.update(slowest_step_s=round(max(after), 3), steps=len(after),
                                bound_s=STEP_BOUND_S)
    assert max(after) < STEP_BOUND_S, after


def test_steps_while_the_master_is_frozen(benchmark: Any, master: Any) -> None:
    e = _engine(master.address, "bench-frozen")
    thaw = threading.Timer(3.0, lambda: master.signal(signal.SIGCONT))

    def freeze() -> None:
        master.signal(signal.SIGSTOP)
        thaw.start()

    try:
        _slowest(benchmark, lambda: _serve(e, _prompts(6), fault_at=1, fault=freeze)[1])
    finally:
        thaw.cancel()
        master.signal(signal.SIGCONT)
        e.shutdown()


def test_steps_after_the_master_died(benchmark: Any, master: Any) -> None:
    prompts = _prompts(6)
    e1 = _engine(master.address, "bench-killed")
    _serve(e1, prompts)
    e2 = _engine(master.address, "bench-killed")
    try:
        _slowest(benchmark, lambda: _serve(e2, [p + [5] * 9 for p in prompts], fault_at=1,
                                           fault=master.kill)[1])
    finally:
        e2.shutdown()
        e1.shutdown()
