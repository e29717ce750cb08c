"""Value format v1: a sealed value verifies; every way a value can be wrong is named."""

from __future__ import annotations

import numpy as np
import pytest

from tailproof.impl.value_format import (
    HEADER_BYTES,
    SECRET_ENV,
    SecretError,
    ValueCodec,
    secret_from_env,
    slot_nbytes,
)

FP = bytes.fromhex("0123456789abcdef")
KEY = "kv1:ns@0123456789abcdef@e0@t0p0@g0@aa"


def sealed(codec: ValueCodec, key: str = KEY, n: int = 1000) -> np.ndarray:
    slot = np.zeros(slot_nbytes(n), np.uint8)
    slot[HEADER_BYTES:] = np.arange(n) % 251
    codec.seal(key, slot)
    return slot


def test_sealed_value_verifies_and_header_is_fixed_size() -> None:
    codec = ValueCodec(FP)
    slot = sealed(codec)
    assert slot.nbytes == 1000 + 128 and codec.verify(KEY, slot) is None
    assert bytes(slot[:4]) == b"TPKV" and int.from_bytes(bytes(slot[4:6]), "little") == 1


@pytest.mark.parametrize("where,kind", [
    (0, "format"),  # magic
    (4, "format"),  # version (an older format)
    (16, "length"),  # payload length
    (24, "fingerprint"),
    (32, "key"),
    (48, "checksum"),  # stored checksum
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
    secret = b"s" * 32
    codec = ValueCodec(FP, secret)
    slot = sealed(codec)
    assert codec.verify(KEY, slot) is None
    assert ValueCodec(FP, b"t" * 32).verify(KEY, slot) == "mac"  # another secret
    assert ValueCodec(FP).verify(KEY, slot) == "mac"  # unauthenticated reader, MAC'd value
    assert codec.verify(KEY, sealed(ValueCodec(FP))) == "mac"  # MAC required, none present
    # A writer without the secret who fixes up the checksum still fails the MAC.
    forged = slot.copy()
    forged[HEADER_BYTES + 3] ^= 1
    ValueCodec(FP).seal(KEY, forged)  # valid checksum, no MAC flag
    forged[6] |= 1  # claim a MAC
    assert codec.verify(KEY, forged) == "mac"


def test_secret_only_from_environment_and_long_enough() -> None:
    assert secret_from_env({}) is None
    assert secret_from_env({SECRET_ENV: "x" * 16}) == b"x" * 16
    with pytest.raises(SecretError, match=SECRET_ENV):
        secret_from_env({SECRET_ENV: "short"})
