"""The one interface every KV store implements, and the outcome type its calls return.

Semantics: ``tailproof.reference.connector.store``. Mirrors the per-key return codes of
Mooncake's ``MooncakeDistributedStore`` as vLLM 0.33's ``MooncakeStoreWorker`` reads them.

Why: "fail closed is a type". A raw store (Mooncake's ``get``) answers ``b''`` for a miss, for a
value larger than its local buffer and for a dead master alike; ``put`` of an existing key answers
0 without writing. Here every call answers one :class:`Outcome` per key, and a caller can only use
loaded bytes after checking ``outcome.ok`` -- anything else (miss, full, error, timeout) means
"recompute", never "use these bytes".

Buffers (decision): a *buffer* is any C-contiguous CPU object exposing its raw bytes:
``memoryview``/``bytearray``/``bytes`` (``bytes`` only for puts), a ``numpy.ndarray`` of any dtype
or a CPU ``torch.Tensor`` of any dtype. It is always treated as its raw ``nbytes`` bytes (never as
``len(arr)`` elements, which is Mooncake's silent-truncation gotcha). The connector's usual case is
a view into one pinned uint8 staging buffer (numpy uint8 or torch uint8): stores that can do
zero-copy I/O (Mooncake) do it when the buffer lies inside a region given to
:meth:`Store.register_buffer`, and copy otherwise. :func:`as_bytes_array` is the single converter.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import numpy as np

from .copies import INLINE, CopyCrew

# memoryview | bytearray | bytes | numpy.ndarray | torch.Tensor (torch is optional here).
ByteBuffer: TypeAlias = Any
#: ``produce(i, out)`` writes value i into ``out`` (a writable uint8 array of exactly its size).
Produce: TypeAlias = Callable[[int, np.ndarray], None]
#: ``consume(values)`` reads every value of a batch (read-only uint8 arrays, in key order).
Consume: TypeAlias = Callable[[list[np.ndarray]], None]


class Status(enum.Enum):
    """What happened to one key. Only OK (and EXISTS for a put) is a success."""

    OK = "ok"  # put: stored; get: buffer filled with exactly the stored bytes
    EXISTS = "exists"  # put only: key already stored; the existing value is kept (write-once)
    STORE_FULL = "store_full"  # put: no space (Mooncake -200 NO_AVAILABLE_HANDLE)
    MISS = "miss"  # get: key not stored (or evicted); buffer contents are garbage
    TOO_LARGE = "too_large"  # put: value larger than the store can ever hold
    WRONG_SIZE = "wrong_size"  # get: the stored value's size is not the buffer's (proof the
    #                            value is not the one its key names: the caller removes it)
    ERROR = "error"  # anything else (store unreachable, transfer failure, size mismatch, closed)
    TIMEOUT = "timeout"  # the store did not answer within its bounded timeout


@dataclass(frozen=True, slots=True)
class Outcome:
    """Result for one key: a status, the bytes moved when OK, and the backend's code/message.

    ``code`` is the backend's raw code (Mooncake's negative ErrorCode, 0 for the memory store)
    kept for logs and metrics; ``message`` is a short human explanation for non-OK outcomes.
    """

    status: Status
    nbytes: int = 0
    code: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        """True iff the operation fully succeeded (for a put, EXISTS also counts: see ``saved``)."""
        return self.status is Status.OK

    @property
    def saved(self) -> bool:
        """For a put: the key now holds a value (OK, or EXISTS = an earlier writer stored it)."""
        return self.status is Status.OK or self.status is Status.EXISTS

    # Constructors, so call sites read as the status they report.
    @classmethod
    def success(cls, nbytes: int) -> Outcome:
        return cls(Status.OK, nbytes)

    @classmethod
    def exists(cls) -> Outcome:
        return cls(Status.EXISTS)

    @classmethod
    def full(cls, code: int = 0, message: str = "store full") -> Outcome:
        return cls(Status.STORE_FULL, 0, code, message)

    @classmethod
    def miss(cls, code: int = 0, message: str = "not found") -> Outcome:
        return cls(Status.MISS, 0, code, message)

    @classmethod
    def too_large(cls, code: int = 0, message: str = "value too large") -> Outcome:
        return cls(Status.TOO_LARGE, 0, code, message)

    @classmethod
    def wrong_size(cls, code: int = 0, message: str = "stored size differs") -> Outcome:
        return cls(Status.WRONG_SIZE, 0, code, message)

    @classmethod
    def error(cls, code: int = 0, message: str = "error") -> Outcome:
        return cls(Status.ERROR, 0, code, message)

    @classmethod
    def timeout(cls, code: int = 0, message: str = "timed out") -> Outcome:
        return cls(Status.TIMEOUT, 0, code, message)


class StoreError(RuntimeError):
    """A store could not be created or set up (bad config, missing package, no master)."""


def as_bytes_array(buf: ByteBuffer, *, writable: bool = False) -> np.ndarray:
    """View ``buf`` as a 1-D C-contiguous ``uint8`` numpy array over the same memory (no copy).

    Raises ``TypeError`` for non-contiguous or non-CPU buffers and ``ValueError`` for a read-only
    buffer when ``writable`` (a get target). A typed array becomes its raw ``nbytes`` bytes.
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TypeError("buffer must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    elif hasattr(buf, "data_ptr") and hasattr(buf, "numpy"):  # a torch.Tensor (torch optional)
        if buf.device.type != "cpu":
            raise TypeError(f"buffer must be a CPU tensor, got device {buf.device}")
        if not buf.is_contiguous():
            raise TypeError("buffer tensor must be contiguous")
        import torch

        if buf.dtype == torch.uint8 and buf.dim() == 1 and not buf.requires_grad:
            arr = buf.numpy()  # the common case (a staging view), without 3 more tensor ops
        else:
            arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        mv = memoryview(buf)
        if not mv.c_contiguous:
            raise TypeError("buffer must be C-contiguous")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("get target buffer is read-only")
    return arr


class Store(abc.ABC):
    """A batched, write-once key/value store of byte blobs (the KV offload tier).

    Contract (every implementation, tested in tests/impl/stores/test_store_contract.py):

    * Keys are non-empty ``str``. Values are byte buffers (see module docstring).
    * ``put_batch`` is write-once: an existing key answers ``EXISTS`` and keeps its value
      (keys are content hashes, so equal keys mean equal bytes).
    * ``get_batch`` fills caller-provided buffers. ``OK`` means the buffer now holds exactly the
      stored value, whose size equals ``len(buffer)`` in bytes. A stored value larger or
      smaller than the buffer answers ``WRONG_SIZE`` (the connector's values have one size per
      key, so that is proof of a bad value: it removes it). On any non-OK outcome the buffer
      content is unspecified and must not be used.
    * No call raises for a per-key failure, and no call blocks beyond the store's bounded
      timeout. Calls after ``close()`` answer ``ERROR`` (never crash). Programming errors
      (mismatched list lengths, a non-contiguous buffer) raise ``ValueError``/``TypeError``.
    * A store is a cache: a successful put may later be evicted; a get then answers ``MISS``.
    * Implementations are safe to call from several threads.
    """

    #: Short backend name ("memory", "mooncake") used in logs and benchmark tables.
    name: str = "store"
    #: Who copies a batch's values (:meth:`write_batch`'s produce calls, the memory store's
    #: copies, the connector's scatter in ``read_batch``); a store built from a config has its own.
    copies: CopyCrew = INLINE

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is it stored now? Fails closed: an error or timeout answers False."""

    @abc.abstractmethod
    def put_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        """Store ``buffers[i]`` under ``keys[i]``; one outcome per key (OK/EXISTS = saved)."""

    @abc.abstractmethod
    def get_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        """Load ``keys[i]`` into ``buffers[i]`` (writable, exactly the value's size)."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> int:
        """Drop these keys now (a value that failed verification); returns how many were
        removed. Best effort: a key already gone, or an error, is simply not counted."""

    @abc.abstractmethod
    def remove_all(self) -> int:
        """Drop every key (tests, resets); returns how many were removed (-1 if unknown)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store; idempotent. Later calls answer ERROR instead of crashing."""

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Produce,
                    staging: np.ndarray | None = None) -> list[Outcome]:
        """Store values that ``produce(i, out)`` writes straight into their destination.

        The allocate-then-fill form of :meth:`put_batch`, so a caller never makes its own copy
        of the bytes: a store that owns its memory (the memory store) hands out the value's
        final buffer (one pass over the bytes); this default produces into views of
        ``staging`` (a registered region: zero-copy for Mooncake) or a temporary array, then
        calls :meth:`put_batch` (two passes). ``produce`` may be skipped for keys that end
        EXISTS or fail; outcomes as :meth:`put_batch`.
        """
        check_batch(keys, sizes)
        views = _split(staging, sizes)
        self.copies.for_each(len(views), lambda i: produce(i, views[i]), sum(sizes))
        return self.put_batch(keys, views)

    def read_batch(self, keys: Sequence[str], sizes: Sequence[int], consume: Consume,
                   staging: np.ndarray | None = None) -> list[Outcome]:
        """Load values of ``sizes[i]`` bytes; ``consume(values)`` is called once, and only when
        *every* key answered OK (all-or-nothing: a failed batch hands out no bytes).

        The memory store passes its own buffers (no copy before ``consume``); this default
        gets into views of ``staging`` (or a temporary array) first. Outcomes as
        :meth:`get_batch`.
        """
        check_batch(keys, sizes)
        views = _split(staging, sizes)
        outs = self.get_batch(keys, views)
        if outs and all(o.ok for o in outs):
            consume([v[:] for v in views])
        return outs

    def removal_count(self) -> int | None:
        """Keys this store has dropped since it opened (evicted or removed), or None when it
        cannot tell (Mooncake evicts silently). The scheduler's remembered lookups re-ask the
        store after any removal it can see (``lookup.StoreLookup``)."""
        return None

    def change_count(self) -> int | None:
        """Keys this store has added or dropped since it opened, or None when it cannot tell
        every change (Mooncake: other engines' puts, silent evictions). An unchanged count
        means unchanged ``exists`` answers: a remembered lookup then asks nothing."""
        return None

    def register_buffer(self, buffer: ByteBuffer) -> None:  # noqa: B027 - optional hook
        """Declare a long-lived staging buffer so later puts/gets of views into it are zero-copy.

        Call once per staging buffer; the buffer must outlive the registration. Default: no-op.
        """

    def unregister_buffer(self, buffer: ByteBuffer) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register_buffer` (before freeing the buffer). Default: no-op."""

    def put(self, key: str, buffer: ByteBuffer) -> Outcome:
        """Single-key convenience over :meth:`put_batch`."""
        return self.put_batch([key], [buffer])[0]

    def get(self, key: str, buffer: ByteBuffer) -> Outcome:
        """Single-key convenience over :meth:`get_batch`."""
        return self.get_batch([key], [buffer])[0]

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _split(staging: np.ndarray | None, sizes: Sequence[int]) -> list[np.ndarray]:
    """Consecutive views of ``sizes`` bytes into ``staging`` (a temporary if it is too small)."""
    total = sum(sizes)
    buf = staging if staging is not None and staging.nbytes >= total else np.empty(total, np.uint8)
    out, off = [], 0
    for n in sizes:
        out.append(buf[off : off + n])
        off += n
    return out


def check_batch(keys: Sequence[str], buffers: Sequence[Any]) -> None:
    """Raise ValueError for a malformed batch (a programming error, not a store outcome)."""
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"keys must be non-empty str, got {k!r}")
