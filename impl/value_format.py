"""Self-describing store values (format version 2, documented in docs/store-format.md).

Why: a key says which bytes a load wants; the value must prove it holds them before a single
byte reaches the KV cache. Each value is one *slot*: a fixed 128-byte header, then the payload
(one block of one group on one rank, exactly ``KVLayout.block_nbytes``)::

    offset size  field
    0      4     magic  b"TPKV"
    4      2     format version (2), little-endian
    6      2     flags (bit 0: a MAC follows)
    8      4     header size (128)
    12     4     reserved (0)
    16     8     payload length in bytes
    24     8     layout fingerprint (``fingerprint.Fingerprint.raw``)
    32     16    BLAKE2b-128 of the store key (a value copied under another key fails)
    48     16    XXH3-128 of the payload
    64     32    keyed BLAKE2b-256 of bytes [0, 64), the MAC identity and the payload
                 (flag bit 0), else zeros
    96     8     MAC identity (:func:`mac_identity`: derived from the secret; zeros unsigned)
    104    24    reserved (zeros)

:meth:`ValueCodec.verify` checks every field; a mismatch is a failed load, reported by kind
(:data:`FAILURE_KINDS`). The checksum catches corruption and accidental mix-ups; only the MAC
(a secret shared by the engines of one trust domain, from the environment) stops a writer that
is not trusted -- see docs/security.md.

One rule for every failure (docs/store-format.md, "Verification"): every key names this
engine's MAC identity (``keys.KeySpace``), and an engine only ever reads its own keys, so a
value it reads is either its own valid value or corrupt, whatever the kind (another identity in
the header included: under this engine's key that is a flipped bit, a misdirected copy or a
forgery). The caller never serves it and removes it, so the next save rewrites it. Engines on
different secrets address different keys and never read, let alone remove, each other's values.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

import numpy as np
import xxhash

MAGIC = b"TPKV"
FORMAT_VERSION = 2
HEADER_BYTES = 128
FLAG_MAC = 1
_PREFIX = struct.Struct("<4sHHIIQ8s16s16s")  # bytes [0, 64): everything the MAC also covers
_MAC_AT, _MAC_BYTES = 64, 32
_ID_AT, ID_BYTES = 96, 8
#: Environment variable holding the MAC secret (never read from the config file).
SECRET_ENV = "TAILPROOF_STORE_SECRET"
MIN_SECRET_BYTES = 16
#: Why a loaded value was rejected (metrics ``verify_fail_<kind>``).
FAILURE_KINDS = ("format", "length", "identity", "fingerprint", "key", "checksum", "mac")

assert _PREFIX.size == _MAC_AT


class SecretError(ValueError):
    """The MAC secret in the environment is unusable."""


def secret_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The MAC secret from ``$TAILPROOF_STORE_SECRET`` (None when unset); SecretError if short."""
    raw = (os.environ if env is None else env).get(SECRET_ENV)
    if raw is None or raw == "":
        return None
    secret = raw.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{SECRET_ENV} must hold at least {MIN_SECRET_BYTES} bytes, "
                          f"got {len(secret)}")
    return secret


def mac_identity(secret: bytes | None) -> bytes:
    """The 8-byte MAC identity of a secret (zeros: no secret): a keyed BLAKE2b of nothing, so
    it names the secret without revealing it (finding a secret from it is as hard as from a
    MAC). Engines share values exactly when they share the identity."""
    if not secret:
        return bytes(ID_BYTES)
    return hashlib.blake2b(key=secret, digest_size=ID_BYTES, person=b"tailproof-mid1").digest()


def mac_identity_text(secret: bytes | None) -> str:
    """The MAC identity as it appears in a key: ``0`` unsigned, else 16 hex digits."""
    return mac_identity(secret).hex() if secret else "0"


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def slot_nbytes(payload_nbytes: int) -> int:
    """Bytes of a stored value holding ``payload_nbytes`` bytes of KV."""
    return HEADER_BYTES + payload_nbytes


def _as_u8(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return buf.detach().reshape(-1).view(__import__("torch").uint8).numpy()


class ValueCodec:
    """Seals and verifies value slots for one engine (its fingerprint, optional MAC secret)."""

    def __init__(self, fingerprint: bytes, secret: bytes | None = None) -> None:
        if len(fingerprint) != 8:
            raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
        self.fingerprint = fingerprint
        self.secret = secret
        self.flags = FLAG_MAC if secret else 0
        self.identity = mac_identity(secret)

    def _mac(self, prefix: bytes | np.ndarray, payload: np.ndarray) -> bytes:
        assert self.secret is not None
        m = hashlib.blake2b(key=self.secret, digest_size=_MAC_BYTES, person=b"tailproof-kv2")
        m.update(prefix)
        m.update(self.identity)
        m.update(payload)
        return m.digest()

    def seal(self, key: str, slot: Any) -> None:
        """Write the header of ``slot`` (header + payload, payload already in place)."""
        s = _as_u8(slot)
        payload = s[HEADER_BYTES:]
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, self.flags, HEADER_BYTES, 0, payload.nbytes,
                              self.fingerprint, key_digest(key),
                              xxhash.xxh3_128_digest(payload))
        s[:_MAC_AT] = np.frombuffer(prefix, np.uint8)
        mac = self._mac(prefix, payload) if self.secret else bytes(_MAC_BYTES)
        s[_MAC_AT : _MAC_AT + _MAC_BYTES] = np.frombuffer(mac, np.uint8)
        s[_ID_AT : _ID_AT + ID_BYTES] = np.frombuffer(self.identity, np.uint8)
        s[_ID_AT + ID_BYTES : HEADER_BYTES] = 0

    def verify(self, key: str, slot: Any) -> str | None:
        """None if ``slot`` is a valid value of ``key`` for this engine, else the failure kind.

        Checks, in order: magic and version (an older or foreign format reads as "format"),
        payload length, MAC identity (a header naming another secret: "identity"),
        fingerprint, key, checksum, MAC. Under this engine's key every kind means corrupt."""
        s = _as_u8(slot)
        if s.nbytes < HEADER_BYTES:
            return "length"
        magic, version, flags, hbytes, _, length, fp, kd, csum = _PREFIX.unpack_from(s)
        if magic != MAGIC or version != FORMAT_VERSION or hbytes != HEADER_BYTES:
            return "format"
        payload = s[HEADER_BYTES:]
        if length != payload.nbytes:
            return "length"
        if bytes(s[_ID_AT : _ID_AT + ID_BYTES]) != self.identity:
            return "identity"
        if fp != self.fingerprint:
            return "fingerprint"
        if kd != key_digest(key):
            return "key"
        if xxhash.xxh3_128_digest(payload) != csum:
            return "checksum"
        if bool(flags & FLAG_MAC) != bool(self.secret):
            return "mac"
        if self.secret:
            mac = bytes(s[_MAC_AT : _MAC_AT + _MAC_BYTES])
            if mac != self._mac(bytes(s[:_MAC_AT]), payload):
                return "mac"
        return None


def payload_view(slot: Any) -> Any:
    """The payload part of a slot (same memory)."""
    return slot[HEADER_BYTES:]
