"""Store configuration: one validated, frozen record and the ``make_store`` factory.

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

Sizes are ints (bytes) or strings like "256MB", "64 MiB", "1G".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .base import Store, StoreError

MIB = 1 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_ADDR_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:(\d{1,5})$")


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
        m = _SIZE_RE.match(value)
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
        cfg = cls(**vals)
        errors += cfg._cross_check(raw)
        if errors:
            raise StoreConfigError(errors)
        return cfg

    def _cross_check(self, raw: Mapping[str, Any]) -> list[str]:
        errs: list[str] = []
        if self.backend == "memory" and "capacity_bytes" in raw and self.capacity_bytes <= 0:
            errs.append("capacity_bytes: must be > 0")
        if self.backend != "mooncake":
            return errs
        if not self.master_address:
            errs.append("master_address: required for backend 'mooncake' (e.g. '127.0.0.1:50051')")
        elif not _ADDR_RE.match(self.master_address) or not 0 < int(
                self.master_address.rsplit(":", 1)[1]) < 65536:
            errs.append(f"master_address: expected 'host:port', got {self.master_address!r}")
        if 0 < self.global_segment_size < 16 * MIB:
            errs.append("global_segment_size: must be 0 (pure client) or >= 16 MiB "
                        f"(Mooncake rejects smaller), got {self.global_segment_size}")
        if self.local_buffer_size < MIB:
            errs.append(f"local_buffer_size: must be >= 1 MiB, got {self.local_buffer_size}")
        if self.protocol == "rdma" and not self.rdma_devices:
            errs.append("rdma_devices: required when protocol is 'rdma' (e.g. 'mlx5_0')")
        if not self.local_hostname:
            errs.append("local_hostname: must not be empty")
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


def make_store(config: Mapping[str, Any] | StoreConfig) -> Store:
    """Build the configured store (validating a dict first). Mooncake is imported lazily, so a
    memory-store user never needs the mooncake package or libibverbs."""
    cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
    if cfg.backend == "mooncake":
        from .mooncake import MooncakeStore

        return MooncakeStore(cfg)
    from .memory import MemoryStore

    return MemoryStore(cfg.capacity_bytes, evict=cfg.evict)
