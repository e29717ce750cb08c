"""Remembered lookups (``impl.lookup.StoreLookup`` with a request id): the same answer as a
fresh lookup whenever the store's removals are visible, a per-step probe count that does not
grow with the prompt, and a remembered hit the store lost fails its load closed (counted)."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tailproof.conformance.tools.capture_engine.engine import kv_cache_config  # noqa: E402
from tailproof.impl.config import Settings, StoreGeometry  # noqa: E402
from tailproof.impl.connector import build_coordinator  # noqa: E402
from tailproof.impl.keys import KeySpace  # noqa: E402
from tailproof.impl.lookup import StoreLookup  # noqa: E402
from tailproof.impl.scheduler_side import SchedulerSide  # noqa: E402
from tailproof.spec.arithmetic import lcm_all  # noqa: E402


class CountingSet(set):
    """A set that counts the keys it gained or lost (a store's change count)."""

    changes = 0

    def add(self, key: str) -> None:
        self.changes += key not in self
        super().add(key)

    def update(self, *others: object) -> None:
        for other in others:
            for key in other:
                self.add(key)

    def discard(self, key: str) -> None:
        self.changes += key in self
        super().discard(key)


class DictStore:
    """Keys present, with a removal count (None: removals invisible, like Mooncake) and, when
    ``counted``, a change count (every key added or dropped, like the memory store)."""

    def __init__(self, visible: bool = True, counted: bool = False) -> None:
        self.keys: CountingSet = CountingSet()
        self.removed = 0
        self.visible = visible
        self.counted = counted
        self.asked = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.asked += len(keys)
        return [k in self.keys for k in keys]

    def removal_count(self) -> int | None:
        return self.removed if self.visible else None

    def change_count(self) -> int | None:
        return self.keys.changes if self.counted else None

    def drop(self, key: str) -> None:
        if key in self.keys:
            self.keys.discard(key)
            self.removed += 1


def make(groups: tuple[tuple[str, int], ...], h: int, store: DictStore,
         world: int = 1) -> StoreLookup:
    kvc = kv_cache_config(64, groups, h)
    lcm = lcm_all([b for _, b in groups])
    partial = kvc.cache_hit_alignment_tokens == h and lcm > h
    geo = StoreGeometry(core_group_ids=tuple(range(len(groups))),
                        block_sizes=tuple(b for _, b in groups),
                        is_mamba=tuple(k == "mamba" for k, _ in groups), hash_block_size=h,
                        scheduler_block_size=lcm, partial_hits=partial, use_eagle=False,
                        num_blocks=64)
    coord = build_coordinator(geo, kvc, 1)
    return StoreLookup(geo, coord, store.exists, KeySpace("t", "f", world), world,
                       store.removal_count, store.change_count)


GEOMETRIES = [
    ((("full_attention", 16), ("mamba", 16)), 4),
    ((("full_attention", 16), ("mamba", 64)), 16),
    ((("full_attention", 16),), 16),
    ((("full_attention", 32), ("mamba", 64)), 32),
]


@pytest.mark.parametrize(("groups", "h"), GEOMETRIES)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("counted", [False, True], ids=["removals", "changes"])
def test_remembered_equals_fresh_lookup(groups: tuple, h: int, seed: int,
                                        counted: bool) -> None:
    """Random puts (prefix runs, stray keys) and removals between asks: the remembered answer
    is the fresh one after every event (the store reports its removals; ``changes``: every
    change too, so an ask after none asks nothing)."""
    rng = random.Random(seed)
    store = DictStore(counted=counted)
    memo = make(groups, h, store)
    fresh = make(groups, h, DictStore())
    fresh.exists = store.exists
    units = rng.randint(4, 40)
    hashes = [rng.randbytes(8) for _ in range(units)]
    num_tokens = units * h + rng.randint(0, h - 1)
    cands = [(g, hh) for g, hh, _ in memo._candidates(hashes, units * h)]
    for _ in range(40):
        r = rng.random()
        if r < 0.4:  # a prefix run of one group (what a save writes)
            g = rng.randrange(len(groups))
            run = [c for c in cands if c[0] == g][: rng.randint(1, len(cands))]
            store.keys.update(memo.keys.key(0, gg, hh) for gg, hh in run)
        elif r < 0.7 and cands:  # a stray key
            g, hh = rng.choice(cands)
            store.keys.add(memo.keys.key(0, g, hh))
        elif store.keys:  # an eviction, possibly in the middle of a prefix
            store.drop(rng.choice(sorted(store.keys)))
        try:
            want = fresh.lookup(num_tokens, hashes)
        except AssertionError:  # no tail key: both refuse
            for _ in range(2):  # and again: a failed answer is not remembered
                with pytest.raises(AssertionError):
                    memo.lookup(num_tokens, hashes, "r")
            continue
        assert memo.lookup(num_tokens, hashes, "r") == want
        if counted:  # the store is as it was: the memo's answer, nothing asked
            probed = memo.keys_probed
            assert memo.lookup(num_tokens, hashes, "r") == want
            assert memo.keys_probed == probed


def test_unchanged_store_is_asked_nothing() -> None:
    """A store that counts its changes: after the first ask, a waiting request's asks probe no
    key until something is put; the put key is then found (the fresh answer)."""
    groups, h = (("full_attention", 16), ("mamba", 64)), 16
    store = DictStore(counted=True)
    lk = make(groups, h, store)
    hashes = [i.to_bytes(4, "big") for i in range(2048)]
    for u in range(8):  # 128 tokens stored in both groups
        store.keys.add(lk.keys.key(0, 0, hashes[u]))
        if (u + 1) * h % 64 == 0:
            store.keys.add(lk.keys.key(0, 1, hashes[u]))
    first = lk.lookup(2048 * h, hashes, "r")
    assert first.hit_length == 128
    asked = store.asked
    for _ in range(5):
        assert lk.lookup(2048 * h, hashes, "r") == first
    assert store.asked == asked
    for u in range(8, 12):  # the next Mamba block lands: the hit grows to 192
        store.keys.add(lk.keys.key(0, 0, hashes[u]))
    store.keys.add(lk.keys.key(0, 1, hashes[11]))
    grown = lk.lookup(2048 * h, hashes, "r")
    assert grown == lk.lookup(2048 * h, hashes) and grown.hit_length == 192
    asked = store.asked
    assert lk.lookup(2048 * h, hashes, "r") == grown
    assert store.asked == asked


def test_probes_per_ask_do_not_grow_with_the_prompt() -> None:
    """A waiting 32k prompt whose first 8k tokens are stored: after the first ask, each ask
    probes the same few keys as for a 1k prompt (the keys past the hit, up to the frontier)."""
    groups, h = (("full_attention", 16), ("mamba", 64)), 16
    per_ask = {}
    for n_units in (64, 2048):
        store = DictStore()
        lk = make(groups, h, store)
        hashes = [i.to_bytes(4, "big") for i in range(n_units)]
        stored = min(n_units // 2, 512)
        for u in range(stored):
            store.keys.add(lk.keys.key(0, 0, hashes[u]))
            if (u + 1) * h % 64 == 0:
                store.keys.add(lk.keys.key(0, 1, hashes[u]))
        first = lk.lookup(n_units * h, hashes, "r")
        assert first == lk.lookup(n_units * h, hashes)  # the full lookup agrees
        before = lk.keys_probed
        for _ in range(5):
            assert lk.lookup(n_units * h, hashes, "r") == first
        per_ask[n_units] = (lk.keys_probed - before) / 5
    assert per_ask[2048] == per_ask[64] <= 16


def _side(store: DictStore) -> SchedulerSide:
    lk = make((("full_attention", 16), ("mamba", 16)), 16, store)
    return SchedulerSide(Settings(), lk.geo, lk, 1)


def test_seen_removal_shrinks_the_remembered_hit() -> None:
    store = DictStore()
    s = _side(store)
    lk = s.lookup_client
    assert isinstance(lk, StoreLookup)
    hashes = [bytes([i]) * 4 for i in range(8)]
    store.keys.update(lk.keys.key(0, g, hashes[u]) for u in range(4) for g in (0, 1))
    req = SimpleNamespace(request_id="r", num_tokens=8 * 16, block_hashes=hashes)
    assert s.get_num_new_matched_tokens(req, 0) == (64, True)
    store.drop(lk.keys.key(0, 0, hashes[2]))  # evicted in the middle of the prefix
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)


def test_unseen_eviction_fails_the_load_closed_and_is_counted() -> None:
    """Removals invisible (Mooncake): the remembered hit is offered, its load fails (the worker
    reads all or nothing), the failure is counted and the request is recomputed."""
    store = DictStore(visible=False)
    s = _side(store)
    lk = s.lookup_client
    assert isinstance(lk, StoreLookup)
    hashes = [bytes([i]) * 4 for i in range(8)]
    store.keys.update(lk.keys.key(0, g, hashes[u]) for u in range(4) for g in (0, 1))
    req = SimpleNamespace(request_id="r", num_tokens=8 * 16, block_hashes=hashes)
    assert s.get_num_new_matched_tokens(req, 0) == (64, True)
    store.drop(lk.keys.key(0, 0, hashes[2]))
    assert s.get_num_new_matched_tokens(req, 0) == (64, True)  # remembered: not re-asked
    assert s.metrics.c.total("lookups_remembered") == 1
    s.update_connector_output(None, failed_recving={"r"})
    assert s.metrics.c.total("loads_failed") == 1
    assert s.metrics.c.total("remembered_hits_failed") == 1
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed, never re-offered
