"""An in-memory key store whose put outcomes a trace scripts (stands in for Mooncake's
``MooncakeDistributedStore``: ``batch_is_exist`` and ``batch_put_from_multi_buffers``).

Each put batch consumes the next script entry: ``"ok"`` (every key stored), ``"full"`` (every
key fails with -200, ``MOONCAKE_NO_AVAILABLE_HANDLE``, MW:95), ``"error"`` (every key fails
with -1), ``"raise"`` (the call raises), or a list with one of ``"ok" | "full" | "error"`` or an
int code per key (missing entries are ``"ok"``). An exhausted script means ``"ok"``. Keys whose
code is >= 0 are stored. Both adapters use this class, so a scripted outcome means the same
thing to both; the store is scaffolding, not the system under test.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

OK = 0
NO_AVAILABLE_HANDLE = -200
OTHER_ERROR = -1
_NAMED = {"ok": OK, "full": NO_AVAILABLE_HANDLE, "error": OTHER_ERROR}


class StoreRaised(RuntimeError):
    """A scripted exception from a put batch."""


def check_script(script: Any) -> list[Any]:
    """Validate a ``store`` script (ValueError with a one-line reason)."""
    if not isinstance(script, list):
        raise ValueError("store script must be a list")
    for i, entry in enumerate(script):
        if isinstance(entry, str) and (entry in _NAMED or entry == "raise"):
            continue
        if isinstance(entry, list) and all(
                (isinstance(x, str) and x in _NAMED)
                or (isinstance(x, int) and not isinstance(x, bool)) for x in entry):
            continue
        raise ValueError(f"store script entry {i}: {entry!r} is not ok/full/error/raise or a "
                         "list of per-key codes")
    return script


def codes_for(entry: Any, n: int) -> list[int] | None:
    """Per-key result codes of one put batch, or None when the call raises."""
    if entry == "raise":
        return None
    if isinstance(entry, list):
        out = [_NAMED[x] if isinstance(x, str) else int(x) for x in entry[:n]]
        return out + [OK] * (n - len(out))
    return [_NAMED[entry]] * n


class ScriptedStore:
    """Keys present (with an observation tag each) plus the script and a log of put batches."""

    def __init__(self) -> None:
        self.keys: dict[Hashable, Any] = {}
        self.script: deque[Any] = deque()
        self.log: list[tuple[list[Any], Any]] = []  # (tags of the batch, script entry)
        self.removals = 0  # keys removed (a store event the connector sees: remembered lookups)
        self.changes = 0  # keys added or removed (unchanged: a remembered lookup asks nothing)

    def set_script(self, script: list[Any]) -> None:
        self.script = deque(check_script(script))

    def batch_is_exist(self, keys: Sequence[Hashable]) -> list[int]:
        return [1 if k in self.keys else 0 for k in keys]

    def put(self, keys: Sequence[Hashable], tags: Sequence[Any]) -> list[int]:
        entry = self.script.popleft() if self.script else "ok"
        self.log.append((list(tags), entry))
        codes = codes_for(entry, len(keys))
        if codes is None:
            raise StoreRaised("scripted store exception")
        for key, tag, code in zip(keys, tags, codes, strict=True):
            if code >= 0:
                self.add(key, tag)
        return codes

    def add(self, key: Hashable, tag: Any) -> None:
        """Hold ``key`` (seeded or put) with its observation tag."""
        self.changes += key not in self.keys
        self.keys[key] = tag

    def remove(self, keys: Sequence[Hashable]) -> int:
        n = 0
        for k in keys:
            if self.keys.pop(k, None) is not None:
                n += 1
        self.removals += n
        self.changes += n
        return n
