"""The canonical state hash (spec/symmetry.py): it is constant on a block/rank renaming of a
state, the transitions and invariants commute with the renaming, merged states are renamings of
each other, and the reduced search explores exactly the orbits of the unreduced one."""

from __future__ import annotations

import random
from itertools import permutations

import pytest

from tailproof.spec.invariants import check
from tailproof.spec.model import Config, State
from tailproof.spec.proofs.bmc import bmc
from tailproof.spec.proofs.mutants import MUTANTS, MutantConfig
from tailproof.spec.symmetry import (
    canonical_after_worker_step,
    canonical_jobs,
    rename,
    rename_action,
)

#: small instances that reach store jobs on both ranks, CoW, turn-end slots and junction jobs
CONFIGS = {
    "default": (Config(), 8),
    "h1": (Config(h=1, bs_fa=1, bs_mamba=2), 7),
    "turn_end": (Config(prompts=((1, 1, 2, 2), (1, 1, 2, 2, 3, 3)), responses=((3, 3), (4,)),
                        turn_end=True), 7),
    "junction": (Config(h=2, bs_fa=2, bs_mamba=8, prompts=((1, 1, 2, 2, 3, 3),
                                                          (1, 1, 2, 2, 4, 4, 4)),
                        junctions=(0, 4)), 7),
}


def _reachable(cfg: Config, depth: int, model: type[State] = State,
               reduce: bool = False) -> list[State]:
    """Every state within ``depth`` steps, one per fingerprint (raw ids unless ``reduce``)."""
    s0 = model(cfg)
    seen = {s0.fingerprint(reduce): s0}
    frontier = [s0]
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for a in s.enabled():
                t = s.apply(a)
                f = t.fingerprint(reduce)
                if f not in seen and not check(t):
                    seen[f] = t
                    nxt.append(t)
        frontier = nxt
    return list(seen.values())


def _random_renaming(rng: random.Random, cfg: Config) -> tuple[list[int], list[int]]:
    blocks = list(range(1, cfg.num_blocks))
    rng.shuffle(blocks)
    ranks = list(range(cfg.workers))
    rng.shuffle(ranks)
    return [0, *blocks], ranks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_renaming_is_a_symmetry(name: str) -> None:
    """On every reachable state: the hash is the same after a random renaming, every invariant
    gives the same verdict, and each action's successor is the renamed successor."""
    cfg, depth = CONFIGS[name]
    rng = random.Random(22)
    states = _reachable(cfg, depth)
    assert len(states) > 300
    with_jobs = 0
    for s in states:
        pi, rho = _random_renaming(rng, cfg)
        t = rename(s, pi, rho)
        assert t.fingerprint() == s.fingerprint()
        assert [n for n, _ in check(t)] == [n for n, _ in check(s)]
        assert sorted(rename_action(a, pi, rho) for a in s.enabled()) == sorted(t.enabled())
        for a in s.enabled():
            assert t.apply(rename_action(a, pi, rho)).fingerprint() == \
                s.apply(a).fingerprint(), (name, a)
        with_jobs += bool(s.jobs and s.store)
    assert with_jobs  # the rank renaming was exercised, not only the identity


def test_merged_states_are_renamings_of_each_other() -> None:
    """Soundness of the merge: two states with one hash differ by some renaming (found by
    brute force over every block and rank permutation, on a sample of merged pairs)."""
    cfg, depth = CONFIGS["default"]
    first: dict[tuple, State] = {}
    pairs = []
    for s in _reachable(cfg, depth):
        f = s.fingerprint()
        if f in first and len(pairs) < 6:
            pairs.append((first[f], s))
        first.setdefault(f, s)
    assert len(pairs) == 6
    for a, b in pairs:
        target = b.fingerprint(False)
        assert any(rename(a, [0, *pi], list(rho)).fingerprint(False) == target
                   for rho in permutations(range(cfg.workers))
                   for pi in permutations(range(1, cfg.num_blocks)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reduced_search_explores_exactly_the_orbits(name: str) -> None:
    """The reduced search's state count is the number of distinct orbits (canonical hashes)
    among the states the unreduced search reaches at the same bound, and fewer states."""
    cfg, depth = CONFIGS[name]
    plain = _reachable(cfg, depth)
    orbits = {s.fingerprint() for s in plain}
    reduced = bmc(cfg, depth)
    unreduced = bmc(cfg, depth, symmetry=False)
    assert reduced.ok and unreduced.ok
    assert unreduced.states == len(plain)
    assert reduced.states == len(orbits) < len(plain)


@pytest.mark.parametrize("name", ["te_snapshot_late", "pin_null", "no_key_move"])
def test_mutant_models_commute_with_renaming(name: str) -> None:
    """A mutant's rule (and its extra state, ``te_snapshot_late``'s late copies) is a symmetry
    too, so the reduced search kills what the unreduced one kills."""
    m = MUTANTS[name]
    cfg = MutantConfig(**{**vars(Config()), **m.overrides, "mutant": name})
    rng = random.Random(7)
    for s in _reachable(cfg, 6, m.model)[:400]:
        pi, rho = _random_renaming(rng, cfg)
        t = rename(s, pi, rho)
        if hasattr(s, "_late"):
            t._late = [(rid, pi[a], pi[b], n) for rid, a, b, n in s._late]
        assert t.fingerprint() == s.fingerprint()
        for a in s.enabled():
            assert t.apply(rename_action(a, pi, rho)).fingerprint() == s.apply(a).fingerprint()
    assert bmc(cfg, 12, model=m.model).ok is bmc(cfg, 12, model=m.model, symmetry=False).ok \
        is False


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_worker_step_hash_from_the_parent_is_the_full_hash(name: str) -> None:
    """The bounded search rebuilds a worker step's successor hash from its parent's
    (:func:`canonical_after_worker_step`): on every run_job and report of every state within
    the bound, reduced and not, it is the hash :func:`canonical_jobs` computes in full, renaming
    included, or None (a job's last report, or the walk relabelled the blocks: the search then
    computes it in full)."""
    cfg, depth = CONFIGS[name]
    rebuilt: dict[str, int] = {"run_job": 0, "report": 0}
    for s in _reachable(cfg, depth, reduce=True):
        for reduce in (True, False):
            fp, lab, _ren, jobs = canonical_jobs(s, reduce)
            for a in s.enabled():
                t = s.apply(a)
                got = canonical_after_worker_step(s, fp, lab, jobs, t, a, reduce)
                if got is None:
                    last = a[0] == "report" and len(s.jobs[a[1]].reported) + 1 == cfg.workers
                    assert a[0] not in rebuilt or last or reduce, a  # raw ids: labels stay
                    continue
                assert got == canonical_jobs(t, reduce), (name, a)
                rebuilt[a[0]] += 1
    assert rebuilt["run_job"] > 100 and rebuilt["report"] > 10, rebuilt
