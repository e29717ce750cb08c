"""Store configuration: one validated, frozen record (``make_store`` is in ``factory``).

Semantics: none in the reference (start-up validation only). Mirrors the store settings vLLM
0.33's ``MooncakeStoreWorker.__init__`` reads from ``kv_connector_extra_config``.

Why: a connector config comes in as a plain dict (vLLM's ``kv_connector_extra_config``); a typo
must fail at startup with one clear line per bad field, not as a store that silently misbehaves.

Fields (``backend`` picks which apply; unknown keys are errors)::

    backend              "memory" (default) | "mooncake"
    capacity_bytes       memory: total bytes held (default 1 GiB)
    evict                memory: drop least-recently-used values when full (default True);
                         False answers STORE_FULL instead
    master_address       mooncake: "host:port" of mooncake_master (required)
    protocol             mooncake: "tcp" (default) | "rdma"
    rdma_devices         mooncake: device list for rdma, e.g. "mlx5_0" (default "")
    global_segment_size  mooncake: bytes this client contributes (0 or >= 16 MiB; default 256 MiB)
    local_buffer_size    mooncake: client staging buffer (default 64 MiB)
    local_hostname       mooncake: address advertised to peers (default "127.0.0.1")
    metadata_server      mooncake: default "P2PHANDSHAKE" (no metadata service)
    rpc_timeout_ms       mooncake: bound for one master RPC (default 3000)
    setup_retries        mooncake: master connection attempts at setup (default 1, ~4.4 s each)
    copy_threads         both: threads that copy one batch's values (the caller counts as one;
                         default 2, at most 8): see ``tailproof.impl.stores.copies``

Sizes are ints (bytes) or strings like "256MB", "64 MiB", "1G" (binary units), the same syntax
for every size key of the connector. A size must fit in this machine's memory (every size here
is memory this process allocates). Settings of the other backend are errors, not ignored.
Addresses and host names are checked strictly (no whitespace, no trailing newline).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .base import StoreError

MIB = 1 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"(\d+) ?([KMGT]?)(I?B)?", re.IGNORECASE)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_ADDR_RE = re.compile(r"(?P<host>[^\s\[\]]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})")
_URL_RE = re.compile(r"[a-z][a-z0-9+.\-]*://[\x21-\x7e]+")
#: Settings that belong to one backend only (the other backend rejects them).
BACKEND_FIELDS = {
    "memory": ("capacity_bytes", "evict"),
    "mooncake": ("master_address", "protocol", "rdma_devices", "global_segment_size",
                 "local_buffer_size", "local_hostname", "metadata_server", "rpc_timeout_ms",
                 "setup_retries"),
}


def machine_memory_bytes() -> int:
    """Physical memory of this machine (the bound for any size this process allocates)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


def human_size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def check_size_fits(name: str, n: int) -> str | None:
    """A problem line when ``n`` bytes cannot be allocated on this machine, else None."""
    total = machine_memory_bytes()
    if n > total:
        return (f"{name}: {human_size(n)} is more than this machine's memory "
                f"({human_size(total)})")
    return None


def check_host(value: str) -> None:
    """Raise ValueError unless ``value`` is a host name or an IP address, nothing else."""
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if len(value) > 253 or not _HOST_RE.fullmatch(value):
        raise ValueError(f"expected a host name or IP address, got {value!r}")


def check_address(value: str) -> None:
    """Raise ValueError unless ``value`` is exactly ``host:port`` (IPv6 as ``[addr]:port``)."""
    m = _ADDR_RE.fullmatch(value)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"expected 'host:port', got {value!r}")
    check_host(m["host"])


class StoreConfigError(StoreError, ValueError):
    """Invalid store config; ``errors`` holds one line per bad field."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid store config:\n  " + "\n  ".join(errors))


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like "64MB"/"64 MiB"/"1G" (binary units). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("a size, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be >= 0")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m:
            return int(m.group(1)) * _UNITS[m.group(2).upper()]
    raise ValueError(f"expected bytes as int or e.g. '64MB', got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Validated store settings (see module docstring for meanings and defaults)."""

    backend: str = "memory"
    capacity_bytes: int = 1 << 30
    evict: bool = True
    master_address: str = ""
    protocol: str = "tcp"
    rdma_devices: str = ""
    global_segment_size: int = 256 * MIB
    local_buffer_size: int = 64 * MIB
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    rpc_timeout_ms: int = 3000
    setup_retries: int = 1
    copy_threads: int = 2

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StoreConfig:
        """Validate ``raw``; raise :class:`StoreConfigError` listing every bad field."""
        known = {f.name for f in fields(cls)}
        errors = [f"{k}: unknown field (known: {', '.join(sorted(known))})"
                  for k in raw if k not in known]
        vals: dict[str, Any] = {}

        def take(name: str, conv: Any) -> None:
            if name not in raw:
                return
            try:
                vals[name] = conv(raw[name])
            except (TypeError, ValueError) as e:
                errors.append(f"{name}: {e}")

        take("backend", lambda v: _choice(v, ("memory", "mooncake")))
        take("protocol", lambda v: _choice(v, ("tcp", "rdma")))
        for name in ("capacity_bytes", "global_segment_size", "local_buffer_size"):
            take(name, parse_size)
        for name in ("rdma_devices", "local_hostname", "metadata_server", "master_address"):
            take(name, _string)
        take("evict", _bool)
        take("rpc_timeout_ms", lambda v: _int_in(v, 100, 600_000))
        take("setup_retries", lambda v: _int_in(v, 1, 100))
        take("copy_threads", lambda v: _int_in(v, 1, 8))
        cfg = cls(**vals)
        errors += cfg._cross_check(raw)
        if errors:
            raise StoreConfigError(errors)
        return cfg

    def _cross_check(self, raw: Mapping[str, Any]) -> list[str]:
        errs: list[str] = []
        for other, names in BACKEND_FIELDS.items():
            if other != self.backend:
                errs += [f"{k}: a setting of the {other!r} store, but the store is "
                         f"{self.backend!r} (remove it)" for k in names if k in raw]
        if self.backend == "memory":
            if "capacity_bytes" in raw and self.capacity_bytes <= 0:
                errs.append("capacity_bytes: must be > 0")
            elif bad := check_size_fits("capacity_bytes", self.capacity_bytes):
                errs.append(bad)
            return errs
        if self.backend != "mooncake":
            return errs
        if not self.master_address:
            errs.append("master_address: required for backend 'mooncake' (e.g. '127.0.0.1:50051')")
        elif "master_address" in raw:
            try:
                check_address(self.master_address)
            except ValueError as e:
                errs.append(f"master_address: {e}")
        for name in ("global_segment_size", "local_buffer_size"):
            if name in raw and (bad := check_size_fits(name, getattr(self, name))):
                errs.append(bad)
        if self.global_segment_size + self.local_buffer_size > machine_memory_bytes() and not any(
                e.startswith(("global_segment_size", "local_buffer_size")) for e in errs):
            errs.append("global_segment_size: with local_buffer_size more than this machine's "
                        f"memory ({human_size(machine_memory_bytes())})")
        if "metadata_server" in raw and self.metadata_server != "P2PHANDSHAKE" and (
                not _URL_RE.fullmatch(self.metadata_server)):
            errs.append("metadata_server: expected 'P2PHANDSHAKE' or a URL such as "
                        f"'http://host:port/metadata', got {self.metadata_server!r}")
        if self.rdma_devices and not re.fullmatch(r"[A-Za-z0-9_.:\-]+(,[A-Za-z0-9_.:\-]+)*",
                                                  self.rdma_devices):
            errs.append(f"rdma_devices: expected e.g. 'mlx5_0,mlx5_1', got {self.rdma_devices!r}")
        if 0 < self.global_segment_size < 16 * MIB:
            errs.append("global_segment_size: must be 0 (pure client) or >= 16 MiB "
                        f"(Mooncake rejects smaller), got {self.global_segment_size}")
        if self.local_buffer_size < MIB:
            errs.append(f"local_buffer_size: must be >= 1 MiB, got {self.local_buffer_size}")
        if self.protocol == "rdma" and not self.rdma_devices:
            errs.append("rdma_devices: required when protocol is 'rdma' (e.g. 'mlx5_0')")
        if not self.local_hostname:
            errs.append("local_hostname: must not be empty")
        else:
            try:
                check_host(self.local_hostname)
            except ValueError as e:
                errs.append(f"local_hostname: {e}")
        return errs


def _choice(v: Any, options: tuple[str, ...]) -> str:
    if v not in options:
        raise ValueError(f"expected one of {', '.join(map(repr, options))}, got {v!r}")
    return str(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true/false, got {v!r}")
    return v


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _int_in(v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an int, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"must be in [{lo}, {hi}], got {v}")
    return v

