"""KV stores behind the tailproof connector: one interface, an embedded default, Mooncake.

Semantics: ``tailproof.reference.connector.store`` (a key is present or absent; a put batch
answers per-key codes, -200 for a full store). Mirrors the store calls of vLLM 0.33's
``MooncakeStoreWorker`` (``batch_is_exist``, ``batch_put_from``, ``batch_get_into``).

Import the interface from here::

    from tailproof.impl.stores import Outcome, Status, Store, make_store
    with make_store({"backend": "memory", "capacity_bytes": "1GB"}) as store:
        outs = store.put_batch(keys, views)      # one Outcome per key; .saved / .ok
"""

from .base import ByteBuffer, Outcome, Status, Store, StoreError, as_bytes_array
from .config import StoreConfig, StoreConfigError, parse_size
from .factory import make_store
from .memory import FaultScript, MemoryStore

__all__ = [
    "ByteBuffer", "FaultScript", "MemoryStore", "Outcome", "Status", "Store", "StoreConfig",
    "StoreConfigError", "StoreError", "as_bytes_array", "make_store", "parse_size",
]
