"""Admission for calls into a native store client: never after close, fail fast while it is down.

Semantics: ``tailproof.reference.connector.store`` (a refused call answers as a failed one).
Mirrors no vLLM function: vLLM 0.33's ``MooncakeStoreWorker`` calls the client unguarded.

Why: Mooncake's client segfaults when used after ``close()``, and with a dead master each call
blocks ~4.5 s (its reconnect wait; ``MC_RPC_TIMEOUT_MS`` does not shorten it) while its
``health_check()`` keeps answering "healthy" for several seconds. This guard (1) counts in-flight
calls so ``close`` waits for them and later calls are refused, and (2) is a circuit breaker: once
a call reports the backend unreachable (``trip``), every call fails closed at once, and one
background thread probes until the backend answers again, then lets calls through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

CLOSED = "store is closed"


class CallGuard:
    """``with guard.call() as down:`` -- ``down`` is None to proceed, else why to fail closed."""

    def __init__(self, health: Callable[[], str | None], probe: Callable[[], bool],
                 probe_interval_s: float = 0.2) -> None:
        self._health = health  # cheap, local: a reason if the client knows it is unhealthy
        self._probe = probe  # a real round trip: True once the backend answers again
        self._interval = probe_interval_s
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._down: str | None = None
        self._prober: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def down_reason(self) -> str | None:
        """Why calls currently fail fast (None when the breaker is closed)."""
        return self._down

    def _enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def _exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @contextmanager
    def call(self) -> Iterator[str | None]:
        if not self._enter():
            yield CLOSED
            return
        try:
            reason = self._down or self._health()
            if reason and not self._down:
                self.trip(reason)
            yield reason
        finally:
            self._exit()

    def trip(self, reason: str) -> None:
        """Mark the backend down; calls fail fast until the background probe succeeds."""
        with self._cond:
            if self._closed:
                return
            self._down = reason
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                                name="store-probe")
                self._prober.start()

    def _probe_loop(self) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, timeout=self._interval):
                    return
            if not self._enter():
                return
            try:
                if self._health() is None and self._probe():
                    with self._cond:
                        self._down = None
                        self._prober = None
                    return
            finally:
                self._exit()

    def close(self, wait: bool = True) -> bool:
        """Refuse new calls; with ``wait``, also wait for in-flight ones (and the probe).
        False if already closed."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.notify_all()
        if wait:
            self.wait_idle()
        return True

    def wait_idle(self) -> None:
        """Block until no call (nor the probe) is inside the client."""
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0)
