"""``make_store``: the configured store from a dict or a :class:`StoreConfig`.

Semantics: none in the reference (start-up wiring only). Mirrors the backend choice of vLLM
0.33's ``MooncakeStoreWorker.__init__`` (the store settings in ``kv_connector_extra_config``).

Why its own module: the factory knows every backend and every backend knows the config, so the
factory sits above both (``config`` <- ``mooncake``/``memory`` <- ``factory``); in ``config`` it
closed an import cycle with ``mooncake``. The ``mooncake`` package itself is still imported only
when a Mooncake store is built (``mooncake._load_client_class``), so a memory-store user never
needs it or libibverbs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Store
from .config import StoreConfig
from .memory import MemoryStore
from .mooncake import MooncakeStore


def make_store(config: Mapping[str, Any] | StoreConfig) -> Store:
    """Build the configured store (validating a dict first)."""
    cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_dict(config)
    if cfg.backend == "mooncake":
        return MooncakeStore(cfg)
    return MemoryStore(cfg.capacity_bytes, evict=cfg.evict, copy_threads=cfg.copy_threads)
