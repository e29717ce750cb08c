"""A stored value is verified before a byte reaches the KV cache, by one rule for every failure
kind (docs/store-format.md, "Verification"): under this engine's key a value is its valid value
or corrupt, so every value that fails -- a header field, the identity, the MAC, the checksum,
the length, a truncation, the format version -- fails the load closed, is counted by kind and
removed, and the writer's next save makes the next load a verified hit; values under another
secret's keys are never read and stay -- on the memory store and on a real Mooncake master. The
worker agrees with the reference rule (``reference/connector/verification.py``)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from stored_values import (
    load,
    load_keys,
    loaded_right,
    mamba_key,
    overwrite,
    read_value,
    save,
    stored,
    untouched,
    worker,
)
from worker_geometry import HASHES

from tailproof.impl.stores import MemoryStore, Store, make_store
from tailproof.impl.value_format import HEADER_BYTES, ValueCodec
from tailproof.reference.connector.store import ScriptedStore
from tailproof.reference.connector.verification import Corrupt, verified_load


@pytest.fixture(params=["memory", "mooncake"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    address = request.getfixturevalue("mooncake_master")
    s = make_store({"backend": "mooncake", "master_address": address})
    s.remove_all()
    try:
        yield s
    finally:
        s.remove_all()
        s.close()


SECRET = b"k" * 32
OTHER_SECRET = b"r" * 32
#: (value, its key, the writer's codec) -> the value as the store then holds it
Change = Callable[[np.ndarray, str, ValueCodec], np.ndarray]


def _flip(at: int, bit: int = 0x10) -> Change:
    def f(v: np.ndarray, key: str, codec: ValueCodec) -> np.ndarray:
        v[at] ^= bit
        return v
    return f


def _set(at: int, raw: bytes) -> Change:
    def f(v: np.ndarray, key: str, codec: ValueCodec) -> np.ndarray:
        v[at : at + len(raw)] = np.frombuffer(raw, np.uint8)
        return v
    return f


def _payload_length_field(v: np.ndarray, key: str, codec: ValueCodec) -> np.ndarray:
    n = int.from_bytes(bytes(v[16:24]), "little")
    v[16:24] = np.frombuffer((n - 1).to_bytes(8, "little"), np.uint8)
    return v


def _forge_mac(v: np.ndarray, key: str, codec: ValueCodec) -> np.ndarray:
    """A writer without the secret: changed payload, fixed-up checksum, identity left as is."""
    v[HEADER_BYTES + 5] ^= 1
    v[48:64] = np.frombuffer(xxhash.xxh3_128_digest(v[HEADER_BYTES:]), np.uint8)
    return v


def _sealed_by(secret: bytes | None) -> Change:
    """A valid value for this key and fingerprint, but sealed under ``secret``'s identity: a
    forgery by a writer without this engine's secret (None), or a misdirected copy."""
    def f(v: np.ndarray, key: str, codec: ValueCodec) -> np.ndarray:
        v[HEADER_BYTES + 5] ^= 1  # what the forger wants served
        ValueCodec(codec.fingerprint, secret).seal(key, v)
        return v
    return f


@dataclass(frozen=True)
class Bad:
    """One corruption: the kind it fails as, how, the engines' secret, and whether the stored
    size changes (then the store itself refuses the read: ``WRONG_SIZE``)."""

    kind: str
    change: Change
    secret: bytes | None = None
    wrong_size: bool = False


CORRUPTIONS: dict[str, Bad] = {
    # the length
    "truncation": Bad("length", lambda v, k, c: v[: v.nbytes - 64].copy(), wrong_size=True),
    "truncated to the header": Bad("length", lambda v, k, c: v[:HEADER_BYTES].copy(),
                                   wrong_size=True),
    "oversize": Bad("length", lambda v, k, c: np.concatenate([v, np.zeros(64, np.uint8)]),
                    wrong_size=True),
    "header field: payload length": Bad("length", _payload_length_field),
    # the format version and the other header fields
    "format version older (1)": Bad("format", _set(4, (1).to_bytes(2, "little"))),
    "format version newer (3)": Bad("format", _set(4, (3).to_bytes(2, "little"))),
    "old format (no header)": Bad("format", lambda v, k, c: np.concatenate(
        [np.zeros(HEADER_BYTES, np.uint8), v[HEADER_BYTES:]])),
    "header field: magic": Bad("format", _flip(1)),
    "header field: header size": Bad("format", _flip(8, 0x01)),
    "header field: fingerprint": Bad("fingerprint", _flip(24)),
    "header field: key digest (copied from another key)": Bad("key", _flip(40)),
    # the identity
    "identity bit flip": Bad("identity", _flip(96, 0x01)),
    "identity bit flip, signed": Bad("identity", _flip(103, 0x80), SECRET),
    "forged without the secret (unsigned)": Bad("identity", _sealed_by(None), SECRET),
    "copied from another secret": Bad("identity", _sealed_by(OTHER_SECRET), SECRET),
    "signed value under an unsigned key": Bad("identity", _sealed_by(OTHER_SECRET)),
    # the checksum
    "payload bit flip": Bad("checksum", _flip(HEADER_BYTES + 5)),
    "stored checksum": Bad("checksum", _flip(50)),
    # the MAC
    "forged MAC (identity copied)": Bad("mac", _forge_mac, SECRET),
    "MAC bit flip": Bad("mac", _flip(80), SECRET),
    "MAC flag cleared": Bad("mac", _flip(6, 0x01), SECRET),
}


def test_every_failure_kind_is_named() -> None:
    from tailproof.impl.value_format import FAILURE_KINDS

    assert {b.kind for b in CORRUPTIONS.values()} == set(FAILURE_KINDS)


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_bad_value_fails_closed_is_counted_removed_and_repaired(store: Store, what: str) -> None:
    bad = CORRUPTIONS[what]
    w, runner = worker(store, bad.secret)
    save(w, runner)
    key = mamba_key(w)
    n = w._slot(1)
    overwrite(store, key, bad.change(read_value(store, key, n), key, w.codec))

    r, rrun = worker(store, bad.secret)  # another engine of the same identity loads it
    ok, before = load(r, rrun)
    assert not ok and untouched(rrun, before)  # fail closed: nothing was scattered
    counters = r.metrics.c.totals()
    assert {k: v for k, v in counters.items() if k.startswith("verify_")} == {
        f"verify_fail_{bad.kind}": 1, "verify_removed": 1}
    assert store.exists([key]) == [False]  # removed: lookups now miss it

    save(w, runner, job=1)  # the writer's next save of that prefix rewrites it (write-once)
    assert store.exists([key]) == [True]
    assert read_value(store, key, n).nbytes == n
    r2, rrun2 = worker(store, bad.secret)
    ok, _ = load(r2, rrun2)
    assert ok and loaded_right(rrun2)
    assert not any(k.startswith("verify_") for k in r2.metrics.c.totals())


@pytest.mark.parametrize("secrets", [(SECRET, OTHER_SECRET), (None, SECRET), (SECRET, None)],
                         ids=["rotated", "writer unsigned", "reader unsigned"])
def test_engines_on_different_secrets_never_read_each_others_keys(
        store: Store, secrets: tuple[bytes | None, bytes | None]) -> None:
    """Two engines share a pool and a namespace on different secrets (a rotation, or one
    engine without the variable): each misses the other's values, never reads them (nothing
    fails verification) and leaves them intact."""
    mine, theirs = secrets
    a, arun = worker(store, mine)
    save(a, arun)
    copies = stored(store, a)
    assert copies
    b, brun = worker(store, theirs)
    assert b.key(0, HASHES[0]) != a.key(0, HASHES[0])  # the MAC identity is in the key
    for _ in range(3):  # every hit, not just the first
        ok, before = load(b, brun)
        assert not ok and b.metrics.c.total("get_fail_miss") >= 1 and untouched(brun, before)
    assert not any(k.startswith("verify_") for k in b.metrics.c.totals())  # never read
    after = stored(store, a)  # intact, byte for byte
    assert after.keys() == copies.keys()
    assert all(np.array_equal(after[k], v) for k, v in copies.items())
    save(b, brun)  # b's own values live beside a's; each engine now loads its own
    for secret in (mine, theirs):
        r, rrun = worker(store, secret)
        ok, _ = load(r, rrun)
        assert ok and loaded_right(rrun)


def test_another_identitys_values_under_this_key_are_removed_and_repaired(store: Store) -> None:
    """Met under this engine's own keys (misdirected copies of a whole prefix), values of
    another MAC identity are corrupt like any other: never served, every one removed, and the
    next save repairs the prefix; the other engine's values under its own keys stay."""
    other, orun = worker(store, OTHER_SECRET)
    save(other, orun)
    me, mrun = worker(store, SECRET)
    theirs = stored(store, other)
    for k, v in theirs.items():  # every value, under this engine's keys
        assert store.put(k.replace(other.keys.mac_identity, me.keys.mac_identity), v).ok
    r, rrun = worker(store, SECRET)
    ok, before = load(r, rrun)
    assert not ok and untouched(rrun, before)
    read = len(load_keys(r))
    assert r.metrics.c.total("verify_fail_identity") == read >= 2  # attention and Mamba
    assert r.metrics.c.total("verify_removed") == read
    assert not any(store.exists([k for _, k in load_keys(r)]))
    after = stored(store, other)  # the other engine's own values: untouched
    assert after.keys() == theirs.keys()
    assert all(np.array_equal(after[k], v) for k, v in theirs.items())
    save(me, mrun)
    r2, rrun2 = worker(store, SECRET)
    ok, _ = load(r2, rrun2)
    assert ok and loaded_right(rrun2)


# --- the worker against the reference rule ---------------------------------------------------

MISSING = "missing"
#: per read key: None (intact), MISSING (absent) or a corruption of CORRUPTIONS (signed engine)
Pattern = tuple[str | None, ...]
PATTERNS = 24


def _pattern(i: int, n: int, seed: int = 31) -> Pattern:
    """Pattern ``i`` for ``n`` read keys: hand-picked ones first, then seeded random ones."""
    picked: list[Pattern] = [(None,) * n, (MISSING,) + (None,) * (n - 1),
                             ("truncation",) + ("payload bit flip",) * (n - 1),
                             (MISSING, "oversize") + ("identity bit flip",) * (n - 2),
                             (MISSING,) + ("payload bit flip",) * (n - 1)]
    if i < len(picked):
        return picked[i]
    rnd = random.Random(seed * 1000 + i)
    choices = [None, None, MISSING, *CORRUPTIONS]
    return tuple(rnd.choice(choices) for _ in range(n))


@pytest.mark.parametrize("i", range(PATTERNS))
def test_worker_follows_the_reference_rule(i: int) -> None:
    """Each key a load reads is intact, absent or corrupt; the worker's outcome (served or
    not, failures by kind, the keys it removed) is the reference's, and the keys of another
    identity (an engine on another secret saved the same prefix) stay untouched in both."""
    store = MemoryStore()
    w, runner = worker(store, SECRET)
    save(w, runner)
    neighbour, nrun = worker(store, OTHER_SECRET)
    save(neighbour, nrun)
    theirs = stored(store, neighbour)
    ref = ScriptedStore()
    for k in stored(store, w):
        ref.add(k, ("A", k))
    for k in theirs:
        ref.add(k, ("neighbour", k))
    keys = load_keys(w)
    pattern = _pattern(i, len(keys))
    for (g, key), what in zip(keys, pattern, strict=True):
        if what == MISSING:
            assert store.remove([key]) == 1 and ref.remove([key]) == 1
        elif what is not None:
            bad = CORRUPTIONS[what]
            overwrite(store, key, bad.change(read_value(store, key, w._slot(g)), key, w.codec))
            ref.add(key, Corrupt(bad.kind, bad.wrong_size))

    want = verified_load(ref, [k for _, k in keys])
    r, rrun = worker(store, SECRET)
    ok, before = load(r, rrun)
    assert ok == want.served, pattern
    assert loaded_right(rrun) if ok else untouched(rrun, before)
    counters = r.metrics.c.totals()
    assert Counter({k[len("verify_fail_"):]: v for k, v in counters.items()
                    if k.startswith("verify_fail_")}) == want.failures
    assert counters.get("verify_removed", 0) == len(want.removed)
    present = dict(zip([k for _, k in keys], store.exists([k for _, k in keys]), strict=True))
    assert {k for k, e in present.items() if e} == {k for _, k in keys if k in ref.keys}
    after = stored(store, neighbour)
    assert after.keys() == theirs.keys() and all(ref.keys[k][0] == "neighbour" for k in after)
    assert all(np.array_equal(after[k], v) for k, v in theirs.items())
