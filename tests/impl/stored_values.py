"""Save and load one request's prefix through a ``WorkerSide`` on any store, and reach the
stored values behind the connector's back (the verified-load and lease-read tests share it).

Request A saves 44 tokens (two attention blocks, a Mamba state at 44 and boundary puts);
request B loads them into other blocks (``LOAD_B``).
"""

from __future__ import annotations

import numpy as np
import torch
from worker_geometry import GEO, HASHES, NB, SHAPES, TOKENS, H

from tailproof.conformance.harness.adapters.runner_sim import SimRunner
from tailproof.impl.config import Settings
from tailproof.impl.meta import BoundaryPut, LoadJob, StoreJob, TailKeyBoundary, TailproofMeta
from tailproof.impl.stores import MemoryStore, Store
from tailproof.impl.worker_side import WorkerSide

TABLES = ([1, 2, 3], [0, 0, 6])
PUTS = [BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)]
CTAB = ([7, 8, 9], [0, 0, 10])
LOAD_B = LoadJob(req_id="B", block_ids=CTAB, block_hashes=HASHES, vllm_cached_tokens=0,
                 kvpool_cached_tokens=44,
                 tail_key_boundaries=(TailKeyBoundary(0, 44), TailKeyBoundary(1, 44)))


def worker(store: Store, secret: bytes | None = None) -> tuple[WorkerSide, SimRunner]:
    runner = SimRunner(SHAPES, NB)
    w = WorkerSide(Settings(namespace="verify"), GEO, store, 0, 1, secret=secret,
                   keep_load_outcomes=True)
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
    """Load B; (whether it succeeded, the KV tensors as they were before it)."""
    before = {k: v.clone() for k, v in runner.kv.items() if isinstance(v, torch.Tensor)}
    w.start_load(TailproofMeta(loads=[LOAD_B]))
    assert w.wait_idle(30.0)  # the load runs on the receiver thread
    ok = w.load_ok.pop("B")
    w.take_transfer_results()
    return ok, before


def untouched(runner: SimRunner, before: dict[str, torch.Tensor]) -> bool:
    """True when no KV tensor changed since ``before`` (a failed load scattered nothing)."""
    return all(torch.equal(runner.kv[name], t) for name, t in before.items())


def loaded_right(runner: SimRunner) -> bool:
    """True when B's blocks hold exactly A's prefix (every byte checked by the sim runner)."""
    return runner.check("B", TOKENS, 0, 44, CTAB) == []


def mamba_key(w: WorkerSide) -> str:
    return w.key(1, HASHES[44 // H - 1])


def load_keys(w: WorkerSide) -> list[tuple[int, str]]:
    """(store group, key) of every value ``LOAD_B`` reads, in the order it reads them."""
    return [(g, w.key(g, hh, LOAD_B.epoch)) for g, _, hh in w.load_plan(LOAD_B)]


def read_value(store: Store, key: str, n: int) -> np.ndarray:
    buf = np.empty(n, np.uint8)
    assert store.get(key, buf).ok
    return buf


def stored(store: Store, w: WorkerSide) -> dict[str, np.ndarray]:
    """Every value ``w``'s keys hold in the store now, by key."""
    keys = [(g, w.key(g, h)) for g in range(GEO.num_groups) for h in HASHES]
    found = store.exists([k for _, k in keys])
    return {k: read_value(store, k, w._slot(g))
            for (g, k), e in zip(keys, found, strict=True) if e}


def overwrite(store: Store, key: str, value: np.ndarray) -> None:
    """Replace a stored value behind the connector's back (a bit flip, a truncation, a rogue
    writer); the new value may have another size."""
    if isinstance(store, MemoryStore):
        old = store._data[key]
        store._data[key] = value.copy()
        store._used += value.nbytes - old.nbytes
        return
    rc = store._client.upsert(key, value.tobytes())
    assert rc == 0, rc
