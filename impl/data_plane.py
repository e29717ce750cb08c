"""Background threads that move KV bytes, so store I/O never runs inside the engine step.

Why: a store round trip (tens of milliseconds per 1,024-token chunk of a 7B hybrid, more over a
network) inside ``wait_for_save`` / ``start_load_kv`` stalls every request in the batch. vLLM
0.33's Mooncake store worker hands store jobs to a sending thread and loads to receiving threads
(``KVCacheStoreSendingThread`` / ``KVCacheStoreRecvingThread``); this module is that machinery,
bounded and with a deterministic drive for tests:

* :class:`Lanes` -- N threads, each draining its own FIFO. A job goes to the lane its key hashes
  to, so the jobs of one request run in submission order on one thread (the order the reference
  connector model states) while different requests may overlap. The number of queued + running
  jobs is bounded: :meth:`Lanes.submit` answers False instead of blocking, and the caller applies
  its policy (a save is skipped and counted; a load fails closed).
* :class:`StagingPool` -- a fixed set of host buffers (pinned when the KV cache is on a GPU,
  registered with the store for zero-copy); a background job waits for a free one, the step never
  does.

Copies done on these threads release the GIL (numpy ``copyto``, torch CUDA copies, the store's
native calls), so a 2-core machine keeps one core for the engine step, and the threads run at a
lower CPU priority (``nice``, per thread on Linux; the worker lowers its senders, not its
receivers, which a waiting request depends on): when every core is busy the step's thread
wins, the data plane only delays its own work (which the bounded queues absorb).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

J = TypeVar("J")


class _Lane(Generic[J]):
    """One thread's FIFO. ``permits`` None: free running; an int: jobs it may still start
    (the deterministic drive hands out one permit per job it wants run)."""

    def __init__(self) -> None:
        self.jobs: deque[J] = deque()
        self.running: J | None = None
        self.permits: int | None = None
        self.finished = 0  # jobs run to the end, ever (the drive waits on this)


class Lanes(Generic[J]):
    """A bounded set of FIFO lanes, one daemon thread each (see module docstring).

    ``run(job)`` executes a job on a lane's thread and must not raise (an exception is logged and
    the job counts as finished). ``abandon(job)`` is called instead of ``run`` for every job
    still queued when :meth:`close` gives up waiting, so a caller can report it (release pins,
    fail the load) -- no job is ever dropped silently.
    """

    def __init__(self, name: str, run: Callable[[J], None], abandon: Callable[[J], None], *,
                 threads: int = 1, max_queued: int = 64, manual: bool = False,
                 nice: int = 10) -> None:
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        if max_queued < 1:
            raise ValueError(f"{name}: max_queued must be >= 1, got {max_queued}")
        self.name = name
        self._run = run
        self._abandon = abandon
        self.max_queued = max_queued
        self.nice = nice
        self._cond = threading.Condition()
        self._lanes: list[_Lane[J]] = [_Lane() for _ in range(threads)]
        self._pending = 0  # queued + running, all lanes
        self._closing = False
        if manual:
            for lane in self._lanes:
                lane.permits = 0
        self._threads = [
            threading.Thread(target=self._loop, args=(lane,), daemon=True, name=f"{name}-{i}")
            for i, lane in enumerate(self._lanes)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ submission

    def lane_of(self, key: str) -> int:
        """The lane a key's jobs run on (stable across runs: crc32, not ``hash``)."""
        return zlib.crc32(key.encode()) % len(self._lanes) if len(self._lanes) > 1 else 0

    def submit(self, key: str, job: J) -> bool:
        """Queue ``job`` on ``key``'s lane; False (nothing queued) when full or closing."""
        with self._cond:
            if self._closing or self._pending >= self.max_queued:
                return False
            self._pending += 1
            self._lanes[self.lane_of(key)].jobs.append(job)
            self._cond.notify_all()
        return True

    def queued(self) -> list[J]:
        """Jobs not started yet, lane by lane in FIFO order (a snapshot)."""
        with self._cond:
            return [j for lane in self._lanes for j in lane.jobs]

    @property
    def pending(self) -> int:
        """Queued + running jobs."""
        return self._pending

    # ------------------------------------------------------------------ threads

    def _loop(self, lane: _Lane[J]) -> None:
        if self.nice and hasattr(os, "setpriority"):
            try:  # Linux: a thread id is a valid PRIO_PROCESS target; lowering needs no rights
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid)
                               + self.nice)
            except OSError:
                logger.warning("%s: could not lower the thread's priority", self.name)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (
                    bool(lane.jobs) and (lane.permits is None or lane.permits > 0)))
                if not lane.jobs or (lane.permits is not None and lane.permits <= 0):
                    return  # closing, nothing this lane may still run
                job = lane.jobs.popleft()
                if lane.permits is not None:
                    lane.permits -= 1
                lane.running = job
            try:
                self._run(job)
            except Exception:  # the runner reports its own failures; never kill the lane
                logger.exception("%s: job failed", self.name)
            finally:
                with self._cond:
                    lane.running = None
                    lane.finished += 1
                    self._pending -= 1
                    self._cond.notify_all()

    # ------------------------------------------------------------------ deterministic drive

    def run_next(self, lane_index: int = 0, timeout: float = 120.0) -> J | None:
        """Manual mode: let ``lane_index``'s thread run its next queued job and wait until it
        finished; returns the job (None when that lane is empty)."""
        lane = self._lanes[lane_index]
        with self._cond:
            if lane.permits is None:
                raise RuntimeError(f"{self.name}: run_next needs manual=True")
            if not lane.jobs:
                return None
            job = lane.jobs[0]
            target = lane.finished + 1
            lane.permits += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: lane.finished >= target, timeout):
                raise TimeoutError(f"{self.name}: job did not finish in {timeout} s")
        return job

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running (free-running lanes); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float = 30.0) -> int:
        """Refuse new jobs, let the threads finish what is queued within ``timeout`` (manual
        lanes are released), then hand every job still queued to ``abandon``; joins the
        threads. Returns how many jobs were abandoned."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closing:
                return 0
            for lane in self._lanes:
                if lane.permits is not None:
                    lane.permits = None  # a closing engine runs out what it has
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._pending == 0,
                                max(0.0, deadline - time.monotonic()))
            self._closing = True
            left = [j for lane in self._lanes for j in lane.jobs]
            for lane in self._lanes:
                lane.jobs.clear()
            self._pending -= len(left)
            self._cond.notify_all()
        for job in left:
            try:
                self._abandon(job)
            except Exception:
                logger.exception("%s: abandoning a job failed", self.name)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()) + 5.0)
        return len(left)


class StagingPool:
    """``count`` host buffers of ``nbytes`` each (uint8 tensors; pinned for a GPU KV cache).

    :meth:`take` blocks the calling *background* thread until a buffer is free; a request larger
    than one buffer gets a temporary buffer of its own (counted in ``oversize``) so it can never
    deadlock waiting for memory the pool does not have.
    """

    def __init__(self, count: int, nbytes: int, *, pin: bool = False,
                 register: Callable[[Any], None] | None = None,
                 unregister: Callable[[Any], None] | None = None) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"staging pool needs count >= 1 and nbytes >= 1, got {count}, "
                             f"{nbytes}")
        self.nbytes = nbytes
        self.pin = pin
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                         for _ in range(count)]
        self._free = list(self._buffers)
        self._cond = threading.Condition()
        self._unregister = unregister
        self.oversize = 0
        if register is not None:
            for b in self._buffers:
                register(b)

    @contextmanager
    def take(self, nbytes: int) -> Iterator[torch.Tensor]:
        """A buffer of at least ``nbytes`` bytes for the duration of the ``with`` block."""
        if nbytes > self.nbytes:
            self.oversize += 1
            yield torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            return
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            buf = self._free.pop()
        try:
            yield buf
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()

    @property
    def in_use(self) -> int:
        """Pool buffers taken now (a job holds one while it copies); 0 when every job is done."""
        with self._cond:
            return len(self._buffers) - len(self._free)

    def close(self) -> None:
        """Unregister the buffers (call after every job that used them finished)."""
        if self._unregister is not None:
            for b in self._buffers:
                self._unregister(b)
            self._unregister = None
