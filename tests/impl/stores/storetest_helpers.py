"""Helpers shared by the store tests (a plain module: pytest puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

MIB = 1 << 20


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


def wait_until(pred: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``pred`` every 0.1 s until true or ``timeout_s`` passes: a liveness bound for state
    only the store's own threads change (a breaker's probe, Mooncake's eviction); the caller
    asserts the result, so the timeout only ever fails a test, it never paces one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False
