"""Helpers shared by the store tests (a plain module: pytest puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

MIB = 1 << 20
T = TypeVar("T")


def pattern(seed: int, n: int) -> np.ndarray:
    """n pseudo-random bytes, distinct per seed (so a wrong value never matches by chance)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def mooncake_config(master: str, **overrides: Any) -> dict[str, Any]:
    """A test config: 64 MiB segment, 16 MiB local buffer, 1.5 s RPC timeout, one setup try."""
    cfg: dict[str, Any] = {"backend": "mooncake", "master_address": master,
                           "global_segment_size": 64 * MIB, "local_buffer_size": 16 * MIB,
                           "rpc_timeout_ms": 1500, "setup_retries": 1}
    cfg.update(overrides)
    return cfg


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn(), seconds it took)."""
    t = time.monotonic()
    r = fn()
    return r, time.monotonic() - t


def wait_until(pred: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``pred`` every 0.1 s until true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False
