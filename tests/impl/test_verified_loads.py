"""A stored value is verified before a byte reaches the KV cache: corrupted, foreign, old-format
or unauthenticated values fail the load closed, are counted by kind, are removed, and the next
save rewrites them -- on the memory store and on a real Mooncake master."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from worker_geometry import GEO, HASHES, NB, SHAPES, TOKENS, H

from tailproof.conformance.adapters.runner_sim import SimRunner
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
    """Replace a stored value behind the connector's back (a bit flip, a rogue writer)."""
    if isinstance(store, MemoryStore):
        store._data[key][:] = value
        return
    rc = store._client.upsert(key, value.tobytes())  # type: ignore[attr-defined]
    assert rc == 0, rc


CORRUPTIONS: dict[str, tuple[str, Callable[[np.ndarray], None]]] = {
    "payload bit flip": ("checksum", lambda v: v.__setitem__(HEADER_BYTES + 5, v[HEADER_BYTES + 5]
                                                             ^ 1)),
    "old format (no header)": ("format", lambda v: v.__setitem__(slice(0, HEADER_BYTES), 0)),
    "foreign fingerprint": ("fingerprint", lambda v: v.__setitem__(24, v[24] ^ 0xFF)),
    "copied from another key": ("key", lambda v: v.__setitem__(40, v[40] ^ 0xFF)),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_bad_value_fails_closed_is_counted_removed_and_repaired(store: Store, what: str) -> None:
    kind, corrupt = CORRUPTIONS[what]
    w, runner = worker(store)
    save(w, runner)
    key = mamba_key(w)
    n = w._slot(1)
    value = _read(store, key, n)
    corrupt(value)
    overwrite(store, key, value)

    r, rrun = worker(store)
    ok, before = load(r, rrun)
    assert not ok  # fail closed: nothing was scattered
    for name, t in before.items():
        assert torch.equal(rrun.kv[name], t), name
    assert r.metrics.c.total(f"verify_fail_{kind}") == 1
    assert r.metrics.c.total("verify_removed") == 1
    assert store.exists([key]) == [False]  # removed: lookups now miss it

    save(w, runner, job=1)  # the next save of that prefix rewrites it
    assert store.exists([key]) == [True]
    r2, rrun2 = worker(store)
    ok, _ = load(r2, rrun2)
    assert ok and rrun2.check("B", TOKENS, 0, 44, CTAB) == []


def test_mac_rejects_values_of_writers_without_the_secret() -> None:
    store = MemoryStore()
    outsider, orun = worker(store)  # no secret: checksummed, not authenticated
    save(outsider, orun)
    r, rrun = worker(store, secret=b"k" * 32)
    ok, _ = load(r, rrun)
    assert not ok and r.metrics.c.total("verify_fail_mac") >= 1
    # Each failed load removes the values it rejected; the insider's next save rewrites
    # them authenticated. Within one round per group the prefix loads again.
    insider, irun = worker(store, secret=b"k" * 32)
    for job in range(1, GEO.num_groups + 1):
        save(insider, irun, job=job)
        r2, rrun2 = worker(store, secret=b"k" * 32)
        ok, _ = load(r2, rrun2)
        if ok:
            break
    assert ok and rrun2.check("B", TOKENS, 0, 44, CTAB) == []
