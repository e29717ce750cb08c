"""The embedded default store: in-process, bounded by bytes, thread-safe, Mooncake's outcome codes.

Semantics: ``tailproof.reference.connector.store``. Mirrors Mooncake's
``MooncakeDistributedStore`` as vLLM 0.33's ``MooncakeStoreWorker`` calls it.

Why: the connector must run (and be tested) with no external service. This store answers exactly
the outcomes Mooncake does (STORE_FULL when capacity is exhausted, MISS, TOO_LARGE for a value
larger than the whole capacity, EXISTS for a second put of a key), so connector code tested here
meets no new outcome in production. Tests can script the next outcomes (:class:`FaultScript`)
or take the whole store "down" to exercise fail-closed paths without a real outage.

Memory: values live in private arrays. Arrays of removed/evicted values are kept for reuse by
later puts of the same size (KV blocks have few distinct sizes), so steady-state puts copy into
already-faulted pages at memcpy speed; held + pooled bytes never exceed the capacity. Values of
1 MiB or more start on a 2 MiB boundary (transparent huge pages).

Copies: one single-threaded ``numpy.copyto`` per value, outside the store's lock (it releases
the GIL), spread over the store's copy crew (``copy_threads``, default 2: the caller and one
helper pulling whole values, :mod:`tailproof.impl.stores.copies`), so a batch moves at about
the speed of a 2-thread memcpy and no call starts a parallel region of its own. The
allocate-then-fill calls (:meth:`MemoryStore.write_batch` / :meth:`MemoryStore.read_batch`) let
the connector gather KV straight into a value's final array and scatter straight from it: one
pass over the bytes. A value being read is leased: removing or evicting it meanwhile drops it
from the store but never recycles its array under the reader.

Eviction: with ``evict=True`` (the default, like Mooncake's master) a put that does not fit
drops least-recently-used values first; with ``evict=False`` it answers STORE_FULL.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import numpy as np

from .base import (
    ByteBuffer,
    Consume,
    Outcome,
    Produce,
    Status,
    Store,
    as_bytes_array,
    check_batch,
)
from .copies import CopyCrew

_CLOSED = "store is closed"
_HUGE_PAGE = 2 << 20


def _huge_aligned(n: int) -> np.ndarray:
    """n bytes starting on a 2 MiB boundary, so transparent huge pages can back the value (a
    copy into 4 KiB pages ran ~10% slower, TLB misses). The unaligned head is address space
    only: it is never touched, so it never becomes resident."""
    if n < _HUGE_PAGE // 2:
        return np.empty(n, np.uint8)
    raw = np.empty(n + _HUGE_PAGE, np.uint8)
    off = -raw.ctypes.data % _HUGE_PAGE
    return raw[off : off + n]


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

    def pending(self, op: str) -> int:
        """Scripted outcomes still queued for ``op``."""
        return len(self._queues[op])

    def clear(self) -> None:
        for q in self._queues.values():
            q.clear()
        self.down = False


class MemoryStore(Store):
    """Bounded in-process store; values are private arrays (see module docstring)."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 1 << 30, *, evict: bool = True,
                 copy_threads: int = 2) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.evict = evict
        self.copies = CopyCrew(copy_threads)
        self.faults = FaultScript()
        self._data: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU order: oldest first
        self._filling: dict[str, np.ndarray] = {}  # reserved, being written, not visible yet
        self._used = 0  # bytes of held + reserved values
        self._pool: dict[int, list[np.ndarray]] = {}  # size -> reusable arrays
        self._pooled = 0
        self._leases: dict[int, int] = {}  # id(array) -> readers copying out of it now
        self._lock = threading.Lock()
        self._closed = False
        self._removals = 0  # keys evicted or removed since start (removal_count)
        self._changes = 0  # keys published, evicted or removed since start (change_count)

    @property
    def used_bytes(self) -> int:
        """Bytes of values currently held (or reserved by a write in progress)."""
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes held plus bytes kept for reuse (always <= capacity_bytes)."""
        return self._used + self._pooled

    def keys(self) -> list[str]:
        """The keys held now, least recently used first (tests and ``tailproof smoke``)."""
        with self._lock:
            return list(self._data)

    def value_size(self, key: str) -> int | None:
        """Bytes of the value held under ``key``, or None."""
        with self._lock:
            val = self._data.get(key)
            return None if val is None else val.nbytes

    def exists(self, keys: Sequence[str]) -> list[bool]:
        faults = self.faults
        with self._lock:
            if not (self._closed or faults.down or faults.pending("exists")):  # none scripted
                data = self._data
                return [k in data for k in keys]
            out = []
            for k in keys:
                forced = faults.next("exists")
                if self._closed or forced is not None:
                    out.append(bool(forced and forced.ok))
                    continue
                out.append(k in self._data)
        return out

    # --- writes: reserve under the lock, fill outside it, publish under it ----------------

    def put_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        srcs = [as_bytes_array(b) for b in buffers]
        return self.write_batch(keys, [s.nbytes for s in srcs],
                                lambda i, out: np.copyto(out, srcs[i]))

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Produce,
                    staging: np.ndarray | None = None) -> list[Outcome]:
        """One pass: ``produce`` writes each new value straight into the store's own array."""
        check_batch(keys, sizes)
        with self._lock:
            outs = [self._reserve(k, n) for k, n in zip(keys, sizes, strict=True)]
            mine = [(i, self._filling[keys[i]]) for i, o in enumerate(outs) if o is None]
        done: list[int] = []  # appended from the crew's threads (list.append is atomic)

        def fill(j: int) -> None:
            i, arr = mine[j]
            produce(i, arr)
            done.append(i)

        try:
            self.copies.for_each(len(mine), fill, sum(arr.nbytes for _, arr in mine))
        finally:
            with self._lock:
                for i, arr in mine:
                    del self._filling[keys[i]]
                    if i in done and not self._closed:
                        self._data[keys[i]] = arr
                        self._changes += 1
                        outs[i] = Outcome.success(arr.nbytes)
                    else:  # produce raised (or the store closed): the reservation is undone
                        if not self._closed:
                            self._release(arr)
                        outs[i] = Outcome.error(message=_CLOSED if self._closed else
                                                "value could not be produced")
        return outs

    def _reserve(self, key: str, n: int) -> Outcome | None:
        """Reserve ``n`` bytes for ``key`` (None: reserved, fill it) or answer why not."""
        if self._closed:
            return Outcome.error(message=_CLOSED)
        forced = self.faults.next("put")
        if forced is not None:
            return forced
        if key in self._data or key in self._filling:
            return Outcome.exists()  # write-once; equal keys hold equal bytes
        if n > self.capacity_bytes:
            return Outcome.too_large(message=f"{n} bytes > capacity {self.capacity_bytes}")
        while self._used + n > self.capacity_bytes:
            if not self.evict or not self._data:
                return Outcome.full(message=f"{self._used}+{n} bytes > capacity "
                                    f"{self.capacity_bytes}")
            _, old = self._data.popitem(last=False)
            self._release(old)
            self._removals += 1
            self._changes += 1
        self._filling[key] = self._allocate(n)
        self._used += n
        return None

    def _release(self, arr: np.ndarray) -> None:
        """A value leaves the store: keep its array for reuse (unless a reader holds it)."""
        self._used -= arr.nbytes
        if id(arr) in self._leases:
            return  # the reader keeps it alive; it is garbage once the read ends
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
        return _huge_aligned(n)

    # --- reads: lease under the lock, copy outside it ------------------------------------

    def get_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        dsts = [as_bytes_array(b, writable=True) for b in buffers]
        with self._lock:
            found = [self._lease(k, d.nbytes) for k, d in zip(keys, dsts, strict=True)]
        pairs = [(dst, val) for (_, val), dst in zip(found, dsts, strict=True) if val is not None]
        try:
            self.copies.for_each(len(pairs), lambda j: np.copyto(*pairs[j]),
                                 sum(v.nbytes for _, v in pairs))
        finally:
            self._unlease([val for _, val in found])
        return [out for out, _ in found]

    def read_batch(self, keys: Sequence[str], sizes: Sequence[int], consume: Consume,
                   staging: np.ndarray | None = None) -> list[Outcome]:
        """One pass: ``consume`` reads the store's own arrays (read-only views), only when
        every key is OK."""
        check_batch(keys, sizes)
        with self._lock:
            found = [self._lease(k, n) for k, n in zip(keys, sizes, strict=True)]
        vals = [val for _, val in found]
        try:
            if found and all(val is not None for val in vals):
                views = []
                for val in vals:
                    v = val.view()
                    v.flags.writeable = False
                    views.append(v)
                consume(views)
        finally:
            self._unlease(vals)
        return [out for out, _ in found]

    def _lease(self, key: str, n: int) -> tuple[Outcome, np.ndarray | None]:
        if self._closed:
            return Outcome.error(message=_CLOSED), None
        forced = self.faults.next("get")
        if forced is not None:
            return forced, None
        val = self._data.get(key)
        if val is None:
            return Outcome.miss(), None
        if val.nbytes != n:
            return Outcome.wrong_size(message=f"stored {val.nbytes} bytes, buffer {n}"), None
        self._data.move_to_end(key)  # a read refreshes recency, like a Mooncake lease
        self._leases[id(val)] = self._leases.get(id(val), 0) + 1
        return Outcome.success(val.nbytes), val

    def _unlease(self, vals: Sequence[np.ndarray | None]) -> None:
        with self._lock:
            for val in vals:
                if val is None:
                    continue
                left = self._leases[id(val)] - 1
                if left:
                    self._leases[id(val)] = left
                else:
                    del self._leases[id(val)]

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
            self._removals += n
            self._changes += n
            return n

    def remove_all(self) -> int:
        with self._lock:
            n = len(self._data)
            for arr in self._data.values():
                self._release(arr)
            self._data.clear()
            self._removals += n
            self._changes += n
            return n

    def removal_count(self) -> int | None:
        return self._removals

    def change_count(self) -> int | None:
        # scripted ``exists`` answers are not the keys held: no promise while any is queued
        if self._closed or self.faults.down or self.faults.pending("exists"):
            return None
        return self._changes

    def close(self) -> None:
        self.copies.close()
        with self._lock:
            self._closed = True
            self._data.clear()
            self._pool.clear()
            self._used = self._pooled = 0
