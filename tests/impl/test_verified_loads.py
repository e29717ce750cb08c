"""A stored value is verified before a byte reaches the KV cache, by one rule for every failure
kind (docs/store-format.md, "Verification"): the value is never served; a value proven corrupt
(bit flip, truncation, oversize, header, checksum, MAC under this engine's identity, another
fingerprint or key) is counted by kind, removed, and rewritten by the next save; a value of
another secret is never read (its MAC identity is in the key) and, met under this engine's key,
is a miss that is kept -- on the memory store and on a real Mooncake master."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from worker_geometry import GEO, HASHES, NB, SHAPES, TOKENS, H

from tailproof.conformance.harness.adapters.runner_sim import SimRunner
from tailproof.impl.config import Settings
from tailproof.impl.meta import BoundaryPut, LoadJob, StoreJob, TailKeyBoundary, TailproofMeta
from tailproof.impl.stores import MemoryStore, Store, make_store
from tailproof.impl.value_format import HEADER_BYTES
from tailproof.impl.worker_side import WorkerSide

TABLES = ([1, 2, 3], [0, 0, 6])
PUTS = [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)]
CTAB = ([7, 8, 9], [0, 0, 10])
LOAD_B = LoadJob(req_id="B", block_ids=CTAB, block_hashes=HASHES, vllm_cached_tokens=0,
                 kvpool_cached_tokens=44,
                 tail_key_boundaries=(TailKeyBoundary(0, 44), TailKeyBoundary(1, 44)))


def worker(store: Store, secret: bytes | None = None) -> tuple[WorkerSide, SimRunner]:
    runner = SimRunner(SHAPES, NB)
    w = WorkerSide(Settings(namespace="verify"), GEO, store, 0, 1, secret=secret)
    w.register_kv_caches(runner.kv, runner.layer_names)
    return w, runner


def save(w: WorkerSide, runner: SimRunner, job: int = 0) -> None:
    runner.forward("A", TOKENS, 0, 44, TABLES)
    w.wait_for_save(TailproofMeta(stores=[StoreJob(
        store_job_id=job, req_id="A", token_len_chunk=32, block_ids=TABLES, block_hashes=HASHES,
        boundary_puts=PUTS)]))
    assert w.wait_idle(30.0)  # the put runs off the step, on the sender thread
    w.close_ended_store_requests({"A"}, set())


def load(w: WorkerSide, runner: SimRunner) -> tuple[bool, dict[str, torch.Tensor]]:
    before = {k: v.clone() for k, v in runner.kv.items() if isinstance(v, torch.Tensor)}
    w.start_load(TailproofMeta(loads=[LOAD_B]))
    assert w.wait_idle(30.0)  # the load runs on the receiver thread
    ok = w.load_ok.pop("B")
    w.take_transfer_results()
    return ok, before


def mamba_key(w: WorkerSide) -> str:
    return w.key(1, HASHES[44 // H - 1])


def _read(store: Store, key: str, n: int) -> np.ndarray:
    buf = np.empty(n, np.uint8)
    assert store.get(key, buf).ok
    return buf


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


def overwrite(store: Store, key: str, value: np.ndarray) -> None:
    """Replace a stored value behind the connector's back (a bit flip, a truncation, a rogue
    writer); the new value may have another size."""
    if isinstance(store, MemoryStore):
        old = store._data[key]
        store._data[key] = value.copy()
        store._used += value.nbytes - old.nbytes
        return
    rc = store._client.upsert(key, value.tobytes())  # type: ignore[attr-defined]
    assert rc == 0, rc


def _flip(at: int) -> Callable[[np.ndarray], np.ndarray]:
    def f(v: np.ndarray) -> np.ndarray:
        v[at] ^= 0x10
        return v
    return f


def _forge_mac(v: np.ndarray) -> np.ndarray:
    """A writer without the secret: changed payload, fixed-up checksum, copied identity."""
    import xxhash

    v[HEADER_BYTES + 5] ^= 1
    v[48:64] = np.frombuffer(xxhash.xxh3_128_digest(v[HEADER_BYTES:]), np.uint8)
    return v


SECRET = b"k" * 32
#: what -> (failure kind, corruption, the engines' secret)
CORRUPTIONS: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], bytes | None]] = {
    "payload bit flip": ("checksum", _flip(HEADER_BYTES + 5), None),
    "truncation": ("length", lambda v: v[: v.nbytes - 64].copy(), None),
    "truncated to the header": ("length", lambda v: v[:HEADER_BYTES].copy(), None),
    "oversize": ("length", lambda v: np.concatenate([v, np.zeros(64, np.uint8)]), None),
    "header magic": ("format", _flip(1), None),
    "old format (no header)": ("format", lambda v: np.concatenate(
        [np.zeros(HEADER_BYTES, np.uint8), v[HEADER_BYTES:]]), None),
    "stored checksum": ("checksum", _flip(50), None),
    "foreign fingerprint": ("fingerprint", _flip(24), None),
    "copied from another key": ("key", _flip(40), None),
    "forged MAC": ("mac", _forge_mac, SECRET),
    "MAC bit flip": ("mac", _flip(80), SECRET),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_bad_value_fails_closed_is_counted_removed_and_repaired(store: Store, what: str) -> None:
    kind, corrupt, secret = CORRUPTIONS[what]
    w, runner = worker(store, secret)
    save(w, runner)
    key = mamba_key(w)
    n = w._slot(1)
    overwrite(store, key, corrupt(_read(store, key, n)))

    r, rrun = worker(store, secret)
    ok, before = load(r, rrun)
    assert not ok  # fail closed: nothing was scattered
    for name, t in before.items():
        assert torch.equal(rrun.kv[name], t), name
    assert r.metrics.c.total(f"verify_fail_{kind}") == 1
    assert r.metrics.c.total("verify_removed") == 1
    assert store.exists([key]) == [False]  # removed: lookups now miss it

    save(w, runner, job=1)  # the next save of that prefix rewrites it (write-once: it is gone)
    assert store.exists([key]) == [True]
    assert _read(store, key, n).nbytes == n
    r2, rrun2 = worker(store, secret)
    ok, _ = load(r2, rrun2)
    assert ok and rrun2.check("B", TOKENS, 0, 44, CTAB) == []


def _stored(store: Store, w: WorkerSide) -> dict[str, np.ndarray]:
    """Every value ``w``'s keys hold in the store now, by key."""
    keys = [(g, w.key(g, h)) for g in range(GEO.num_groups) for h in HASHES]
    found = store.exists([k for _, k in keys])
    return {k: _read(store, k, w._slot(g)) for (g, k), e in zip(keys, found, strict=True) if e}


@pytest.mark.parametrize("secrets", [(SECRET, b"r" * 32), (None, SECRET), (SECRET, None)],
                         ids=["rotated", "writer unsigned", "reader unsigned"])
def test_engines_on_different_secrets_miss_and_never_delete(
        store: Store, secrets: tuple[bytes | None, bytes | None]) -> None:
    """Two engines share a pool and a namespace on different secrets (a rotation, or one
    engine without the variable): each misses the other's values, which stay intact."""
    mine, theirs = secrets
    a, arun = worker(store, mine)
    save(a, arun)
    copies = _stored(store, a)
    assert copies
    b, brun = worker(store, theirs)
    assert b.key(0, HASHES[0]) != a.key(0, HASHES[0])  # the MAC identity is in the key
    for _ in range(3):  # every hit, not just the first
        ok, before = load(b, brun)
        assert not ok and b.metrics.c.total("get_fail_miss") >= 1
        assert all(torch.equal(brun.kv[k], t) for k, t in before.items())
    assert b.metrics.c.total("verify_removed") == 0
    after = _stored(store, a)  # intact, byte for byte
    assert after.keys() == copies.keys()
    assert all(np.array_equal(after[k], v) for k, v in copies.items())
    save(b, brun)  # b's own values live beside a's; each engine now loads its own
    for secret in (mine, theirs):
        r, rrun = worker(store, secret)
        ok, _ = load(r, rrun)
        assert ok and rrun.check("B", TOKENS, 0, 44, CTAB) == []


def test_a_value_of_another_identity_under_this_key_is_a_miss_and_kept(store: Store) -> None:
    """Met under this engine's own key (misdirected copies), values of another MAC identity are
    ones this engine cannot verify: never served, never removed."""
    other, orun = worker(store, b"r" * 32)
    save(other, orun)
    me, _ = worker(store, SECRET)
    for k, v in _stored(store, other).items():  # every value, under this engine's keys
        assert store.put(k.replace(other.keys.mac_identity, me.keys.mac_identity), v).ok
    src, dst = mamba_key(other), mamba_key(me)
    r, rrun = worker(store, SECRET)
    ok, before = load(r, rrun)
    assert not ok and all(torch.equal(rrun.kv[k], t) for k, t in before.items())
    assert r.metrics.c.total("verify_fail_identity") >= 2  # attention and Mamba values
    assert r.metrics.c.total("verify_kept_unverifiable") == r.metrics.c.total(
        "verify_fail_identity")
    assert r.metrics.c.total("verify_removed") == 0
    assert store.exists([dst, src]) == [True, True]
