"""The embedded default store: in-process, bounded by bytes, thread-safe, Mooncake's outcome codes.

Semantics: ``tailproof.reference.connector.store``. Mirrors Mooncake's
``MooncakeDistributedStore`` as vLLM 0.33's ``MooncakeStoreWorker`` calls it.

Why: the connector must run (and be tested) with no external service. This store answers exactly
the outcomes Mooncake does (STORE_FULL when capacity is exhausted, MISS, TOO_LARGE for a value
larger than the whole capacity, EXISTS for a second put of a key), so connector code tested here
meets no new outcome in production. Tests can script the next outcomes (:class:`FaultScript`)
or take the whole store "down" to exercise fail-closed paths without a real outage.

Memory: values are copied into private arrays. Arrays of removed/evicted values are kept for
reuse by later puts of the same size (KV blocks have few distinct sizes), so steady-state puts
copy into already-faulted pages at memcpy speed; held + pooled bytes never exceed the capacity.

Eviction: with ``evict=True`` (the default, like Mooncake's master) a put that does not fit
drops least-recently-used values first; with ``evict=False`` it answers STORE_FULL.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import numpy as np

from .base import ByteBuffer, Outcome, Status, Store, as_bytes_array, check_batch

_CLOSED = "store is closed"
_PARALLEL_COPY_BYTES = 1 << 20  # below this a single-threaded memcpy wins


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy of one value; large values use torch's parallel CPU copy when torch is already
    loaded (it is in a vLLM worker), which is about twice numpy's single-threaded rate."""
    torch = sys.modules.get("torch")
    if torch is not None and src.nbytes >= _PARALLEL_COPY_BYTES:
        torch.from_numpy(dst).copy_(torch.from_numpy(src))
    else:
        np.copyto(dst, src)


class FaultScript:
    """Scripted outcomes for tests: the next keys of an op answer these instead of the real thing.

    ``script("get", [Outcome.timeout(), None, Outcome.miss()])``: the next get key times out,
    the one after is served for real (``None``), the third misses. ``down = True`` makes every
    call answer ERROR (exists: False) until reset, like an unreachable master.
    """

    OPS = ("put", "get", "exists")

    def __init__(self) -> None:
        self._queues: dict[str, deque[Outcome | None]] = {op: deque() for op in self.OPS}
        self.down = False

    def script(self, op: str, outcomes: Iterable[Outcome | Status | None]) -> None:
        """Append outcomes (a bare Status becomes a default Outcome of that status) for ``op``."""
        if op not in self._queues:
            raise ValueError(f"op must be one of {self.OPS}, got {op!r}")
        for o in outcomes:
            self._queues[op].append(Outcome(o) if isinstance(o, Status) else o)

    def next(self, op: str) -> Outcome | None:
        """The scripted outcome for the next key of ``op``, or None to do the real operation."""
        if self.down:
            return Outcome.error(message="injected: store down")
        q = self._queues[op]
        return q.popleft() if q else None

    def clear(self) -> None:
        for q in self._queues.values():
            q.clear()
        self.down = False


class MemoryStore(Store):
    """Bounded in-process store; values are private copies (puts copy in, gets copy out)."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 1 << 30, *, evict: bool = True) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.evict = evict
        self.faults = FaultScript()
        self._data: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU order: oldest first
        self._used = 0
        self._pool: dict[int, list[np.ndarray]] = {}  # size -> reusable arrays
        self._pooled = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        """Bytes of values currently held."""
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes held plus bytes kept for reuse (always <= capacity_bytes)."""
        return self._used + self._pooled

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out = []
        with self._lock:
            for k in keys:
                forced = self.faults.next("exists")
                if self._closed or forced is not None:
                    out.append(bool(forced and forced.ok))
                    continue
                out.append(k in self._data)
        return out

    def put_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        srcs = [as_bytes_array(b) for b in buffers]
        with self._lock:
            return [self._put_one(k, s) for k, s in zip(keys, srcs, strict=True)]

    def _put_one(self, key: str, src: np.ndarray) -> Outcome:
        if self._closed:
            return Outcome.error(message=_CLOSED)
        forced = self.faults.next("put")
        if forced is not None:
            return forced
        if key in self._data:
            return Outcome.exists()
        n = src.nbytes
        if n > self.capacity_bytes:
            return Outcome.too_large(message=f"{n} bytes > capacity {self.capacity_bytes}")
        while self._used + n > self.capacity_bytes:
            if not self.evict or not self._data:
                return Outcome.full(message=f"{self._used}+{n} bytes > capacity "
                                    f"{self.capacity_bytes}")
            _, old = self._data.popitem(last=False)
            self._release(old)
        dst = self._allocate(n)
        _copy(dst, src)
        self._data[key] = dst
        self._used += n
        return Outcome.success(n)

    def _release(self, arr: np.ndarray) -> None:
        """A value leaves the store: keep its array for reuse."""
        self._used -= arr.nbytes
        self._pool.setdefault(arr.nbytes, []).append(arr)
        self._pooled += arr.nbytes

    def _allocate(self, n: int) -> np.ndarray:
        """An array of n bytes, reused if possible; drops pooled arrays to stay in capacity."""
        free = self._pool.get(n)
        if free:
            self._pooled -= n
            arr = free.pop()
            if not free:
                del self._pool[n]
            return arr
        while self._pool and self._used + self._pooled + n > self.capacity_bytes:
            size, arrays = next(iter(self._pool.items()))
            arrays.pop()
            self._pooled -= size
            if not arrays:
                del self._pool[size]
        return np.empty(n, np.uint8)

    def get_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        dsts = [as_bytes_array(b, writable=True) for b in buffers]
        with self._lock:
            return [self._get_one(k, d) for k, d in zip(keys, dsts, strict=True)]

    def _get_one(self, key: str, dst: np.ndarray) -> Outcome:
        if self._closed:
            return Outcome.error(message=_CLOSED)
        forced = self.faults.next("get")
        if forced is not None:
            return forced
        val = self._data.get(key)
        if val is None:
            return Outcome.miss()
        if val.nbytes > dst.nbytes:
            return Outcome.too_large(message=f"stored {val.nbytes} bytes > buffer {dst.nbytes}")
        if val.nbytes != dst.nbytes:
            return Outcome.error(message=f"size mismatch: stored {val.nbytes}, "
                                 f"buffer {dst.nbytes}")
        _copy(dst, val)
        self._data.move_to_end(key)  # a read refreshes recency, like a Mooncake lease
        return Outcome.success(val.nbytes)

    def remove(self, keys: Sequence[str]) -> int:
        with self._lock:
            if self._closed:
                return 0
            n = 0
            for k in keys:
                arr = self._data.pop(k, None)
                if arr is not None:
                    self._release(arr)
                    n += 1
            return n

    def remove_all(self) -> int:
        with self._lock:
            n = len(self._data)
            for arr in self._data.values():
                self._release(arr)
            self._data.clear()
            return n

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self._pool.clear()
            self._used = self._pooled = 0
