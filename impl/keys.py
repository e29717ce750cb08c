"""Store keys: which bytes a key names (format ``kv2``, documented in docs/store-format.md).

    kv2:<namespace>@<fingerprint>@m<MAC identity>@e<epoch>@t<tp rank>p<pp rank>
        @g<store group>@<prefix hash hex>      (one line, no spaces)

* ``namespace``: the deployment's choice (engines that should share KV use the same one);
* ``fingerprint``: :mod:`tailproof.impl.fingerprint` -- model identity, dtypes, layer layout,
  parallel sizes, prefix-hash algorithm and seed, block geometry -- so engines whose bytes are
  not interchangeable never share a key (a load across a difference is a miss);
* ``MAC identity``: ``0`` without a secret, else 16 hex digits derived from it
  (``value_format.mac_identity``): engines on different secrets address different keys, so
  they never read -- nor, failing to verify, remove -- each other's values. A rotation moves
  an engine to fresh keys (a cold cache for it; the old values age out, untouched);
* ``epoch``: ``0`` from start-up; a prefix-cache reset moves this engine to a fresh random epoch,
  which makes its earlier keys unreachable *for it* without touching anyone else's keys;
* ``t..p..``: the tensor- and pipeline-parallel rank of the shard (separately: TP=2 rank 1 and
  PP=2 rank 1 are different bytes);
* the store group and vLLM's chained prefix hash (a content address of the token prefix).

The ``kv2`` prefix is the key format version: a later format never reads these keys (``kv1``
keys had no MAC identity; their values, header format 1, are never read).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

KEY_FORMAT = "kv2"
INITIAL_EPOCH = "0"
UNSIGNED = "0"  # the MAC identity of an engine without a secret
_KEY_RE = re.compile(
    r"^kv2:(?P<ns>[^@]+)@(?P<fp>[0-9a-f]+)@m(?P<mac>0|[0-9a-f]{16})@e(?P<epoch>[0-9a-f]+)"
    r"@t(?P<tp>\d+)p(?P<pp>\d+)@g(?P<group>\d+)@(?P<hash>[0-9a-f]+)$")


@dataclass(frozen=True)
class KeySpace:
    """One engine's keys: namespace, layout fingerprint, tensor-parallel size, MAC identity.

    Worker ranks are vLLM's ``tp_rank + pp_rank * tp_size`` (see ``connector._rank``)."""

    namespace: str
    fingerprint: str
    tp_size: int = 1
    mac_identity: str = UNSIGNED  # ``value_format.mac_identity_text`` of the engine's secret

    def __post_init__(self) -> None:
        # (rank, group, epoch) -> the key up to the hash: built once (lookups and puts make
        # thousands of keys a step; the prefix is the same for all of a shard's group)
        object.__setattr__(self, "_prefixes", {})

    def key(self, rank: int, group: int, block_hash: bytes, epoch: str = INITIAL_EPOCH) -> str:
        prefixes: dict[tuple[int, int, str], str] = self._prefixes
        head = prefixes.get((rank, group, epoch))
        if head is None:
            head = self.head(rank, group, epoch)
        return head + block_hash.hex()

    def head(self, rank: int, group: int, epoch: str = INITIAL_EPOCH) -> str:
        """The key of (``rank``, ``group``, ``epoch``) up to the hash: ``head + hash.hex()``
        is :meth:`key` (built once; a lookup makes its keys from these)."""
        prefixes: dict[tuple[int, int, str], str] = self._prefixes
        head = prefixes.get((rank, group, epoch))
        if head is None:
            if len(prefixes) > 1024:  # epochs move at resets: keep the cache bounded
                prefixes.clear()
            tp, pp = rank % self.tp_size, rank // self.tp_size
            head = prefixes[(rank, group, epoch)] = (
                f"{KEY_FORMAT}:{self.namespace}@{self.fingerprint}@m{self.mac_identity}"
                f"@e{epoch}@t{tp}p{pp}@g{group}@")
        return head


@dataclass(frozen=True)
class ParsedKey:
    namespace: str
    fingerprint: str
    mac_identity: str
    epoch: str
    tp_rank: int
    pp_rank: int
    group: int
    block_hash: bytes


def parse_key(key: str) -> ParsedKey:
    """The fields of a ``kv2`` key; ValueError for anything else (e.g. an older format)."""
    m = _KEY_RE.match(key)
    if m is None:
        raise ValueError(f"not a {KEY_FORMAT} store key: {key!r}")
    return ParsedKey(m["ns"], m["fp"], m["mac"], m["epoch"], int(m["tp"]), int(m["pp"]),
                     int(m["group"]), bytes.fromhex(m["hash"]))


def new_epoch() -> str:
    """A fresh epoch for a reset: random, so no other engine or restart can pick it."""
    return secrets.token_hex(4)


class KeyEpoch:
    """The engine's current key epoch, one object owned by the scheduler role
    (``SchedulerSide.move_epoch``) and read by its lookups, so the two never disagree."""

    __slots__ = ("value",)

    def __init__(self, value: str = INITIAL_EPOCH) -> None:
        self.value = value
