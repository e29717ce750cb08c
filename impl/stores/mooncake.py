"""The Mooncake store (``mooncake.store.MooncakeDistributedStore``) behind the :class:`Store` API.

Semantics: ``tailproof.reference.connector.store``. Mirrors the store calls of vLLM 0.33's
``MooncakeStoreWorker`` (``batch_is_exist``, ``batch_put_from``, ``batch_get_into``).

Why a wrapper: the raw client (mooncake-transfer-engine 0.3.13.post1) answers ``b''``
for a miss, an oversized value and a dead master alike; ``put`` of an existing key answers 0
without writing; ``put(float32_array)`` stores ``len`` bytes, not ``nbytes``; calls after
``close()`` segfault; and its default timeouts are 30 s (RPC) and ~90 s (setup with no master).
This module absorbs each of those:

* only the zero-copy calls are used (``batch_put_from``/``batch_get_into``), whose per-key return
  codes map onto :class:`Outcome` (``_outcome_for``); ``get`` is never used;
* write-once: ``batch_is_exist`` first, so an existing key answers EXISTS (not a silent no-op),
  and a key repeated inside one batch is written once;
* buffers become raw-byte views (:func:`as_bytes_array`), so typed arrays are never truncated;
* buffers inside a region given to :meth:`register_buffer` go zero-copy; any other buffer is
  registered for the duration of the call (correct for rdma, cheap for tcp);
* a guard makes every call after ``close()`` answer ERROR, and ``close()`` waits for in-flight
  calls, then unregisters buffers, then closes the client (the safe order);
* bounded time: ``MC_RPC_TIMEOUT_MS``/``MC_RPC_CONNECT_TIMEOUT_MS`` and
  ``MC_STORE_CLIENT_SETUP_RETRIES`` come from the config (they are read at ``setup``; they are
  process-wide env vars). With a dead master each raw call blocks ~4.5 s whatever the env says,
  and ``health_check()`` still answers "healthy" for seconds; so the first RPC_FAIL/RPC_TIMEOUT
  (or ``health_check() == 2``) trips a breaker (:class:`CallGuard`): calls then fail closed at
  once, and a background probe lets them through again when the master answers.

Do not fork a process that holds a store (use the "spawn" start method). Unregister a buffer
only when no call that uses it is in flight.

Works with the non-CUDA wheel (CPU, tcp) and the CUDA wheel (same API). Data lives in the
segments of live clients: closing the last client that holds a value loses it (a later get
answers MISS), as does a master restart.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .base import ByteBuffer, Outcome, Store, StoreError, as_bytes_array, check_batch
from .config import StoreConfig
from .copies import CopyCrew
from .guard import CLOSED, CallGuard

# Mooncake ErrorCode values this wrapper distinguishes (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
          -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
          -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
          -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT"}
_PROBE_KEY = "__tailproof_probe__"
#: Longest ``close()`` takes with the master unreachable (the native close is parked then).
CLOSE_BOUND_S = 3.0
logger = logging.getLogger(__name__)
#: Clients closed while their master was unreachable: their native close runs at exit.
_PARKED_CLIENTS: list[Callable[[], None]] = []


@atexit.register
def _close_parked_clients() -> None:
    while _PARKED_CLIENTS:
        _PARKED_CLIENTS.pop()()


_HEALTH = {1: "store not initialised or closed", 2: "master unreachable"}


def _load_client_class() -> type:
    """Import ``MooncakeDistributedStore`` or raise StoreError with a one-line reason."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "mooncake":
            raise StoreError("mooncake store unavailable: the 'mooncake' package is not installed "
                             "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1; "
                             "mooncake-transfer-engine on CUDA machines)") from e
        raise StoreError(f"mooncake store unavailable: {e}") from e
    except ImportError as e:
        msg = str(e)
        if "libibverbs" in msg:
            raise StoreError("mooncake store unavailable: libibverbs.so.1 is missing "
                             "(apt-get install -y libibverbs1; needed even for tcp)") from e
        if "libcuda" in msg or "libcudart" in msg:
            raise StoreError("mooncake store unavailable: the CUDA wheel is installed but CUDA "
                             "is not (use mooncake-transfer-engine-non-cuda on CPU)") from e
        raise StoreError(f"mooncake store unavailable: {msg}") from e
    return MooncakeDistributedStore


def unavailable_reason() -> str | None:
    """None if the Mooncake client imports here, else the one-line reason (tests skip on it)."""
    try:
        _load_client_class()
    except StoreError as e:
        return str(e)
    return None


def _code_text(code: int) -> str:
    return f"{_NAMES.get(code, 'ERROR')} ({code})"


def _outcome_for(code: int) -> Outcome:
    """Map a negative Mooncake code to a non-OK outcome (shared by puts, gets and lookups)."""
    if code == NO_AVAILABLE_HANDLE:
        return Outcome.full(code, "no space in any segment (NO_AVAILABLE_HANDLE)")
    if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
        return Outcome.miss(code, _code_text(code))
    if code == RPC_TIMEOUT:
        return Outcome.timeout(code, "master did not answer in rpc_timeout_ms (RPC_TIMEOUT)")
    return Outcome.error(code, _code_text(code))


def _down_outcome(reason: str) -> Outcome:
    return Outcome.error(0 if reason == CLOSED else RPC_FAIL, reason)


class MooncakeStore(Store):
    """One Mooncake client: contributes ``global_segment_size`` bytes to the pool and talks to
    the master at ``master_address``. Thread-safe (the client releases the GIL)."""

    name = "mooncake"

    def __init__(self, config: StoreConfig) -> None:
        if config.backend != "mooncake":
            raise StoreError(f"MooncakeStore needs backend 'mooncake', got {config.backend!r}")
        self.config = config
        # MC_LOG_LEVEL is read when the library loads, the others at setup().
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ["MC_RPC_TIMEOUT_MS"] = str(config.rpc_timeout_ms)
        os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(config.rpc_timeout_ms)
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(config.setup_retries)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        client_cls = _load_client_class()
        self._client: Any = client_cls()
        rc = self._client.setup(
            config.local_hostname, config.metadata_server, config.global_segment_size,
            config.local_buffer_size, config.protocol, config.rdma_devices, config.master_address)
        if rc != 0:
            self._client.close()  # safe on a half-initialised client; never used again
            if rc == INVALID_PARAMS:
                raise StoreError(
                    f"mooncake setup rejected the settings ({_code_text(rc)}): check "
                    f"global_segment_size ({config.global_segment_size}), local_buffer_size "
                    f"({config.local_buffer_size}), protocol and local_hostname")
            raise StoreError(f"mooncake setup failed ({_code_text(rc)}): is mooncake_master "
                             f"running at {config.master_address}?")
        self._guard = CallGuard(self._health, self._probe)
        self.copies = CopyCrew(config.copy_threads)  # fills staging in write_batch
        self._registered: dict[int, tuple[int, np.ndarray]] = {}  # start ptr -> (end, array)

    # --- lifetime and health -----------------------------------------------------------------

    def _health(self) -> str | None:
        h = self._client.health_check()
        return _HEALTH.get(h, f"health_check={h}") if h else None

    def _probe(self) -> bool:
        """One real master round trip (used by the guard to end a fail-fast period)."""
        return all(c >= 0 for c in self._client.batch_is_exist([_PROBE_KEY]))

    def _check_codes(self, codes: Sequence[int]) -> None:
        """Trip the fail-fast breaker when a call shows the master unreachable or hung."""
        bad = next((c for c in codes if c in (RPC_FAIL, RPC_TIMEOUT)), None)
        if bad is not None:
            self._guard.trip(f"master unreachable ({_code_text(bad)})")

    def close(self) -> None:
        """Wait for in-flight calls, unregister buffers, then close the client (in that order).

        With the master unreachable the client's close holds the GIL while it retries to
        unmount its segment (2-20 s measured), which would freeze every thread of the engine:
        then the client is parked instead and closed at interpreter exit. Either way later
        calls are refused at once and this returns within :data:`CLOSE_BOUND_S`."""
        self.copies.close()
        master_down = (self._guard.down_reason is not None or self._health() is not None
                       or not self._master_listening())
        if not self._guard.close(wait=not master_down):
            return
        if master_down:
            logger.warning("mooncake master at %s unreachable: the client is closed at exit",
                           self.config.master_address)
            _PARKED_CLIENTS.append(self._release_client)
            return
        self._release_client()

    def _master_listening(self) -> bool:
        """A TCP connect to the master (health_check stays "healthy" for seconds after it dies)."""
        host, _, port = self.config.master_address.rpartition(":")
        if not port.isdigit():
            return True  # not host:port (an HA address): rely on the breaker and health_check
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=0.5).close()
        except OSError:
            return False
        return True

    def _release_client(self) -> None:
        self._guard.wait_idle()  # the client segfaults if closed under a running call
        for ptr in list(self._registered):
            self._client.unregister_buffer(ptr)
        self._registered.clear()
        self._client.close()

    # --- registration ---------------------------------------------------------------------

    def register_buffer(self, buffer: ByteBuffer) -> None:
        arr = as_bytes_array(buffer)
        ptr = arr.ctypes.data
        with self._guard.call() as down:
            if down == CLOSED:
                raise StoreError("register_buffer on a closed store")
            rc = self._client.register_buffer(ptr, arr.nbytes)
        if rc != 0:
            raise StoreError(f"mooncake register_buffer failed: {_code_text(rc)}")
        self._registered[ptr] = (ptr + arr.nbytes, arr)  # keeps the memory alive

    def unregister_buffer(self, buffer: ByteBuffer) -> None:
        ptr = as_bytes_array(buffer).ctypes.data
        if self._registered.pop(ptr, None) is not None and not self._guard.closed:
            self._client.unregister_buffer(ptr)

    def _is_registered(self, ptr: int, n: int) -> bool:
        regions = tuple(self._registered.items())  # snapshot: another thread may register
        return any(start <= ptr and ptr + n <= end for start, (end, _) in regions)

    @contextmanager
    def _registered_for_call(self, arrays: Sequence[np.ndarray]) -> Iterator[set[int]]:
        """Register arrays outside every registered region for this call; yield the indexes
        whose registration failed (those keys answer ERROR)."""
        temp: list[int] = []
        failed: set[int] = set()
        try:
            for i, a in enumerate(arrays):
                p = a.ctypes.data
                if self._is_registered(p, a.nbytes) or p in temp:
                    continue
                if self._client.register_buffer(p, a.nbytes) == 0:
                    temp.append(p)
                else:
                    failed.add(i)
            yield failed
        finally:
            for p in temp:
                self._client.unregister_buffer(p)

    # --- operations -----------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._guard.call() as down:
            if down:
                return [False] * len(keys)
            codes = self._client.batch_is_exist(list(keys))
        self._check_codes(codes)
        return [c == 1 for c in codes]

    def put_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        arrays = [as_bytes_array(b) for b in buffers]
        if not keys:
            return []
        out: list[Outcome | None] = [None] * len(keys)
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        uniq = list(first.values())
        with self._guard.call() as down:
            if down:
                return [_down_outcome(down)] * len(keys)
            codes = self._client.batch_is_exist([keys[i] for i in uniq])
            self._check_codes(codes)
            todo = []
            for i, c in zip(uniq, codes, strict=True):
                if c == 1:
                    out[i] = Outcome.exists()
                elif c == 0:
                    todo.append(i)
                else:
                    out[i] = _outcome_for(c)
            self._transfer(todo, keys, arrays, out, self._client.batch_put_from, put=True)
        for i, k in enumerate(keys):
            if out[i] is None:  # a repeat of keys[first[k]] inside this batch
                o = out[first[k]]
                out[i] = Outcome.exists() if o is not None and o.saved else o
        return out

    def get_batch(self, keys: Sequence[str], buffers: Sequence[ByteBuffer]) -> list[Outcome]:
        check_batch(keys, buffers)
        arrays = [as_bytes_array(b, writable=True) for b in buffers]
        if not keys:
            return []
        out: list[Outcome | None] = [None] * len(keys)
        with self._guard.call() as down:
            if down:
                return [_down_outcome(down)] * len(keys)
            self._transfer(list(range(len(keys))), keys, arrays, out,
                           self._client.batch_get_into, put=False)
        return out

    def _transfer(self, idx: list[int], keys: Sequence[str], arrays: Sequence[np.ndarray],
                  out: list[Outcome | None], op: Callable[..., list[int]], *, put: bool) -> None:
        """Run one zero-copy batch call over ``idx`` and fill ``out`` from its per-key codes."""
        if not idx:
            return
        sel = [arrays[i] for i in idx]
        with self._registered_for_call(sel) as failed:
            for j in failed:
                out[idx[j]] = Outcome.error(message="could not register buffer for transfer")
            run = [(i, a) for j, (i, a) in enumerate(zip(idx, sel, strict=True))
                   if j not in failed]
            if not run:
                return
            codes = op([keys[i] for i, _ in run], [a.ctypes.data for _, a in run],
                       [a.nbytes for _, a in run])
        self._check_codes(codes)
        for (i, a), c in zip(run, codes, strict=True):
            out[i] = self._result(c, a.nbytes, put)

    @staticmethod
    def _result(code: int, size: int, put: bool) -> Outcome:
        if put:
            return Outcome.success(size) if code == 0 else _outcome_for(code)
        if code == size:
            return Outcome.success(size)
        if code >= 0:  # fewer bytes stored than the buffer holds: the tail is stale
            return Outcome.wrong_size(message=f"stored {code} bytes, buffer {size}")
        if code == INVALID_PARAMS:  # "User buffer too small" is the only -600 of get_into
            return Outcome.wrong_size(code, f"stored value larger than buffer ({size} bytes)")
        return _outcome_for(code)

    def remove(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with self._guard.call() as down:
            if down:
                return 0
            codes = self._client.batch_remove(list(keys), True)  # force: ignore read leases
        self._check_codes(codes)
        return sum(1 for c in codes if c == 0)

    def remove_all(self) -> int:
        with self._guard.call() as down:
            if down:
                return -1
            n = self._client.remove_all(True)  # force: ignore read leases
        self._check_codes([n])
        return n if n >= 0 else -1
