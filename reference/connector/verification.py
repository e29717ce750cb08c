"""The verified-load rule: what a load does with values that are not what their keys name.

DEVIATION (``TailproofConnector`` only): vLLM 0.33's receiver gets values straight into the
KV cache and fails a load only on a negative per-key code
(``KVCacheStoreRecvingThread._handle_request``, MW:1123-1312, ``batch_get_into_multi_buffers``
and ``failed``); tailproof verifies every value first (docs/store-format.md, "Verification").
A value in the reference store is its observation tag; one that is not what its key names is
a :class:`Corrupt` carrying the first check it fails. The rule, stated once:

* an engine reads only its own keys, and every key names the engine's MAC identity, so under
  its key a value is either the engine's valid value or corrupt -- whatever the failure kind;
* a load reads every key of its request, all or nothing: a key absent is a miss (the load
  fails, nothing is removed); a value of the wrong stored size is answered by the store itself
  (``WRONG_SIZE``, kind ``length``) before any byte is read; every other value is checked only
  when every key arrived;
* any failure fails the load closed (nothing served) and every failing value is removed and
  counted by kind, so the writer's next save (write-once) stores it again;
* keys the load does not read -- another identity's, another epoch's -- are never touched.

``tailproof.impl.worker_side`` (``_get_values``, ``_reject``) states the same rule
independently; ``tests/impl/test_verified_loads.py`` compares the two on random corruptions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tailproof.reference.connector.store import ScriptedStore

#: The checks of a value, in the order they run (``verify_fail_<kind>`` counters).
FAILURE_KINDS = ("format", "length", "identity", "fingerprint", "key", "checksum", "mac")


@dataclass(frozen=True)
class Corrupt:
    """A stored value that is not what its key names: the first check it fails, and whether its
    stored size differs from the slot (then the store refuses it before a byte is read)."""

    kind: str
    wrong_size: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"Corrupt.kind: {self.kind!r} is not one of {FAILURE_KINDS}")
        if self.wrong_size and self.kind != "length":
            raise ValueError("Corrupt.wrong_size: a wrong stored size fails as 'length'")


@dataclass
class LoadResult:
    """What one load did: served (every value verified and copied), failures by kind, and the
    keys it removed (in the order they were read)."""

    served: bool
    failures: Counter[str] = field(default_factory=Counter)
    removed: list[Hashable] = field(default_factory=list)


def verified_load(store: ScriptedStore, keys: Sequence[Hashable]) -> LoadResult:
    """One request's load of ``keys`` (this engine's own keys) under the rule above."""
    _absent = object()
    values = [store.keys.get(k, _absent) for k in keys]
    refused = [isinstance(v, Corrupt) and v.wrong_size for v in values]
    bad = [(k, "length") for k, r in zip(keys, refused, strict=True) if r]
    arrived = all(v is not _absent for v in values) and not any(refused)
    if arrived:
        bad = [(k, v.kind) for k, v in zip(keys, values, strict=True) if isinstance(v, Corrupt)]
    if not bad:
        return LoadResult(served=arrived and bool(keys))
    failing = [k for k, _ in bad]
    present = [k for k in failing if k in store.keys]
    store.remove(present)
    return LoadResult(False, Counter(kind for _, kind in bad), present)
