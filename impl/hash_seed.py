"""Whether this engine's prefix hashes can agree with another process's (docs/impl.md,
"Prefix hashes across processes").

Store keys are vLLM's block hashes, which chain from ``NONE_HASH``. vLLM 0.33 derives it in every
engine core (``init_none_hash``, ``v1/core/kv_cache_utils.py``, called from ``EngineCore.__init__``)
from a seed that ``resolve_none_hash_seed`` picks: ``PYTHONHASHSEED`` when set; otherwise a fixed
default for the cryptographic algorithms (``sha256``, ``sha256_cbor``) and ``os.urandom`` for the
non-cryptographic ones (``xxhash``, ``xxhash_cbor``). With the latter and no ``PYTHONHASHSEED``
no other engine -- nor this one after a restart -- can ever derive the keys this engine stores.
Different seeds or algorithms are safe (the layout fingerprint names both, so keys differ and
lookups miss) but share nothing; only the random seed is detectable from inside one engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``_NON_CRYPTO_HASH_FUNCTIONS`` of vLLM 0.33 (``v1/core/kv_cache_utils.py``), by config name.
NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def random_seed_problem(cache_config: Any, env: Mapping[str, str]) -> str | None:
    """Why this engine's block hashes are private to its process (None when they are not)."""
    algo = getattr(cache_config, "prefix_caching_hash_algo", "sha256")
    if algo not in NON_CRYPTO_ALGOS or env.get("PYTHONHASHSEED") is not None:
        return None
    return (f"prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED gives every process a "
            "random hash seed (vLLM's resolve_none_hash_seed): no other engine, nor this one "
            "after a restart, will ever hit what it stores (fix: set PYTHONHASHSEED to one "
            "value on every engine sharing the store, or use prefix_caching_hash_algo "
            "'sha256' / 'sha256_cbor')")
