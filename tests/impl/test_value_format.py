"""Value format v2: a sealed value verifies; every way a value can be wrong is named by the
first check it fails (a header naming another MAC identity included: ``identity``)."""

from __future__ import annotations

import numpy as np
import pytest

from tailproof.impl.value_format import (
    HEADER_BYTES,
    SECRET_ENV,
    SecretError,
    ValueCodec,
    mac_identity,
    mac_identity_text,
    secret_from_env,
    slot_nbytes,
)

FP = bytes.fromhex("0123456789abcdef")
KEY = "kv2:ns@0123456789abcdef@m0@e0@t0p0@g0@aa"


def sealed(codec: ValueCodec, key: str = KEY, n: int = 1000) -> np.ndarray:
    slot = np.zeros(slot_nbytes(n), np.uint8)
    slot[HEADER_BYTES:] = np.arange(n) % 251
    codec.seal(key, slot)
    return slot


def test_sealed_value_verifies_and_header_is_fixed_size() -> None:
    codec = ValueCodec(FP)
    slot = sealed(codec)
    assert slot.nbytes == 1000 + 128 and codec.verify(KEY, slot) is None
    assert bytes(slot[:4]) == b"TPKV" and int.from_bytes(bytes(slot[4:6]), "little") == 2


@pytest.mark.parametrize("where,kind", [
    (0, "format"),  # magic
    (4, "format"),  # version (an older format)
    (16, "length"),  # payload length
    (24, "fingerprint"),
    (32, "key"),
    (48, "checksum"),  # stored checksum
    (96, "identity"),  # MAC identity (unsigned: zeros)
    (HEADER_BYTES + 999, "checksum"),  # last payload byte
    (HEADER_BYTES, "checksum"),  # first payload byte
])
def test_each_corruption_is_caught_by_kind(where: int, kind: str) -> None:
    codec = ValueCodec(FP)
    slot = sealed(codec)
    slot[where] ^= 0x40
    assert codec.verify(KEY, slot) == kind


def test_other_key_other_fingerprint_unsealed() -> None:
    codec = ValueCodec(FP)
    slot = sealed(codec)
    assert codec.verify(KEY.replace("@aa", "@ab"), slot) == "key"
    assert ValueCodec(bytes(8)).verify(KEY, slot) == "fingerprint"
    raw = np.zeros(slot_nbytes(1000), np.uint8)  # a value written before format v1
    assert codec.verify(KEY, raw) == "format"
    assert codec.verify(KEY, np.zeros(10, np.uint8)) == "length"


def test_mac_authenticates_header_and_payload() -> None:
    import xxhash

    secret = b"s" * 32
    codec = ValueCodec(FP, secret)
    slot = sealed(codec)
    assert codec.verify(KEY, slot) is None
    assert bytes(slot[96:104]) == mac_identity(secret) != bytes(8)
    # Another secret, or none: the header names another MAC identity than the reader's (under
    # the reader's key that value is corrupt: the worker removes it like any other failure).
    for reader in (ValueCodec(FP, b"t" * 32), ValueCodec(FP)):
        assert reader.verify(KEY, slot) == "identity"
    assert codec.verify(KEY, sealed(ValueCodec(FP))) == "identity"  # unsigned value
    # Under this engine's identity a bad MAC is proof: a forger without the secret who fixes
    # up the checksum and copies the identity still fails the MAC, as does a flipped MAC bit.
    forged = slot.copy()
    forged[HEADER_BYTES + 3] ^= 1
    forged[48:64] = np.frombuffer(xxhash.xxh3_128_digest(forged[HEADER_BYTES:]), np.uint8)
    assert codec.verify(KEY, forged) == "mac"
    flipped = slot.copy()
    flipped[70] ^= 1
    assert codec.verify(KEY, flipped) == "mac"
    unflagged = slot.copy()
    unflagged[6] &= 0xFE  # MAC flag cleared under a signed identity
    assert codec.verify(KEY, unflagged) == "mac"


def test_mac_identity_names_the_secret_without_revealing_it() -> None:
    a, b = mac_identity(b"s" * 32), mac_identity(b"t" * 32)
    assert len(a) == 8 and a != b and a == mac_identity(b"s" * 32)
    assert b"s" not in a and mac_identity(None) == bytes(8)
    assert mac_identity_text(None) == "0" and mac_identity_text(b"s" * 32) == a.hex()


def test_secret_only_from_environment_and_long_enough() -> None:
    assert secret_from_env({}) is None
    assert secret_from_env({SECRET_ENV: "x" * 16}) == b"x" * 16
    with pytest.raises(SecretError, match=SECRET_ENV):
        secret_from_env({SECRET_ENV: "short"})
