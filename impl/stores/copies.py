"""A store's copy crew: a batch's per-value copies spread over the caller and a few helpers.

Why: one ``numpy.copyto`` moves about half the bytes per second that two threads do on this
class of machine, so a single-threaded store put was 0.45x a 2-thread torch copy of the same
bytes. Per-value parallel regions (OpenMP inside every copy) oversubscribe a small machine; a
crew does not: ``threads`` bounds the threads copying for one store at any moment (the caller
counts as one), helpers pull whole values from one counter, and every copy releases the GIL.
Helpers run at their caller's CPU priority: a crew keeps one set per ``nice`` value, started
from a caller of that priority (a Linux thread inherits it), so a low-priority sender's copies
never borrow an engine-priority thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

MIN_PARALLEL_BYTES = 1 << 20  # below this a batch runs on the caller alone: a hand-off costs more


class _Batch:
    """One ``for_each`` call: the next value index, who is copying now, the first error."""

    def __init__(self, n: int, fn: Callable[[int], None]) -> None:
        self.n, self.fn = n, fn
        self.next = 0
        self.running = 0
        self.closed = False  # no index is handed out any more (done, or an error was raised)
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def take(self) -> int | None:
        """The next index to copy (counted as running), or None when there is none left."""
        with self.cond:
            if self.closed or self.next >= self.n:
                return None
            i, self.next = self.next, self.next + 1
            self.running += 1
            return i

    def finish(self, error: BaseException | None) -> None:
        with self.cond:
            self.running -= 1
            if error is not None and self.error is None:
                self.error, self.closed = error, True
            self.cond.notify_all()

    def work(self) -> None:
        while (i := self.take()) is not None:
            try:
                self.fn(i)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                self.finish(e)
                return
            self.finish(None)


class CopyCrew:
    """``for_each(n, fn)`` calls ``fn(i)`` once for each i < n, on at most ``threads`` threads.

    Returns only when no call is running any more (the caller may then release the buffers the
    calls touched); the first exception stops handing out indices and is re-raised. ``fn``
    must be safe to call from several threads at once for different i.
    """

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"copy threads must be >= 1, got {threads}")
        self.threads = threads
        self._crews: dict[int, tuple[queue.SimpleQueue[_Batch | None],
                                     list[threading.Thread]]] = {}  # nice -> (work, helpers)
        self._lock = threading.Lock()
        self._closed = False

    def for_each(self, n: int, fn: Callable[[int], None], nbytes: int | None = None) -> None:
        """Run ``fn(0) … fn(n-1)``; in parallel only when there are helpers, several values
        and (if ``nbytes`` is given) at least :data:`MIN_PARALLEL_BYTES` in all."""
        small = nbytes is not None and nbytes < MIN_PARALLEL_BYTES
        work = None if self.threads == 1 or n < 2 or small else self._helpers()
        if work is None:
            for i in range(n):
                fn(i)
            return
        batch = _Batch(n, fn)
        for _ in range(min(self.threads - 1, n - 1)):
            work.put(batch)
        batch.work()
        with batch.cond:
            batch.closed = True  # a helper that takes the batch late finds nothing to do
            batch.cond.wait_for(lambda: batch.running == 0)
        if batch.error is not None:
            raise batch.error

    def _helpers(self) -> queue.SimpleQueue[_Batch | None] | None:
        """The work queue of this caller's priority, its helpers started (None once closed)."""
        nice = _nice()
        with self._lock:
            if self._closed:
                return None
            work, helpers = self._crews.setdefault(nice, (queue.SimpleQueue(), []))
            while len(helpers) < self.threads - 1:
                t = threading.Thread(target=self._serve, args=(work,), daemon=True,
                                     name=f"tailproof-copy-n{nice}-{len(helpers)}")
                t.start()  # from this caller's thread: it inherits the caller's nice
                helpers.append(t)
            return work

    @staticmethod
    def _serve(work: queue.SimpleQueue[_Batch | None]) -> None:
        while (batch := work.get()) is not None:
            batch.work()

    def close(self) -> None:
        """Stop the helpers (idempotent); later batches run on their caller alone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            crews, self._crews = self._crews, {}
        for work, helpers in crews.values():
            for _ in helpers:
                work.put(None)
        for _, helpers in crews.values():
            for t in helpers:
                t.join(timeout=5)


def _nice() -> int:
    """The calling thread's nice value (per thread on Linux; 0 where it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0


INLINE = CopyCrew(1)  # every copy on the caller: the default for stores without a crew
