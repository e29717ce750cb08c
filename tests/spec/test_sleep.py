"""The bounded search's sleep sets (spec/proofs/sleep.py): every pair of actions declared to
commute does, on every state of a bounded search of each instance ``tailproof prove`` checks; an
action's sleep-set name is the same at every renaming of a state; and the pruned search visits
exactly the orbits the plain breadth-first search reaches."""

from __future__ import annotations

import random

import pytest

from tailproof.spec.invariants import check
from tailproof.spec.model import Config, State
from tailproof.spec.proofs.bmc import bmc
from tailproof.spec.proofs.sleep import commutes, name
from tailproof.spec.prove import BMC_INSTANCES
from tailproof.spec.symmetry import canonical, rename

#: every instance of ``tailproof prove``, at a depth that reaches store jobs on both ranks
INSTANCES = {label: (cfg, min(qdepth, 7)) for label, cfg, _depth, qdepth in BMC_INSTANCES}


def _orbits(cfg: Config, depth: int) -> dict[tuple, State]:
    """Plain BFS (no pruning of any kind): one state per orbit within ``depth`` steps."""
    s0 = State(cfg)
    seen = {s0.fingerprint(): s0}
    frontier = [s0]
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for a in s.enabled():
                t = s.apply(a)
                f = t.fingerprint()
                if f not in seen and not check(t):
                    seen[f] = t
                    nxt.append(t)
        frontier = nxt
    return seen


@pytest.mark.parametrize("label", sorted(INSTANCES))
def test_declared_pairs_commute(label: str) -> None:
    """``s.a.x == s.x.a`` (ids as they are), each stays enabled after the other, and the
    transient result (lookup, reset) of each is the one it has at ``s``."""
    cfg, depth = INSTANCES[label]
    pairs = kinds = 0
    seen_kinds: set[tuple[str, str]] = set()
    for s in _orbits(cfg, depth).values():
        acts = s.enabled()
        after = {a: s.apply(a) for a in acts}
        for i, a in enumerate(acts):
            for x in acts[i + 1:]:
                if not commutes(s, a, x):
                    continue
                assert commutes(s, x, a), (label, a, x)
                sa, sx = after[a], after[x]
                assert x in sa.enabled() and a in sx.enabled(), (label, a, x)
                sax, sxa = sa.apply(x), sx.apply(a)
                assert sax.fingerprint(False) == sxa.fingerprint(False), (label, a, x)
                assert (sax.last_hit, sax.last_reset) == (sx.last_hit, sx.last_reset)
                assert (sxa.last_hit, sxa.last_reset) == (sa.last_hit, sa.last_reset)
                pairs += 1
                seen_kinds.add(tuple(sorted((a[0], x[0]))))
    kinds = len(seen_kinds)
    assert pairs > 100 and kinds >= 3, (pairs, seen_kinds)


@pytest.mark.parametrize("label", sorted(INSTANCES))
def test_pruned_search_visits_every_orbit(label: str) -> None:
    """The search with sleep sets and pruning explores exactly the orbits of the plain BFS, and
    the same count as with the sleep sets off."""
    cfg, depth = INSTANCES[label]
    plain = _orbits(cfg, depth)
    pruned, unslept = bmc(cfg, depth), bmc(cfg, depth, sleep=False)
    assert pruned.ok and unslept.ok
    assert pruned.states == unslept.states == len(plain)
    assert pruned.coverage == unslept.coverage


def test_names_are_the_same_at_every_renaming() -> None:
    """A sleeping action is stored by name: a renamed state has the same names, and the actions
    of one name at the two reach one orbit (where the state has a rank automorphism, the name
    follows the renaming the fingerprint chose, which need not be the random one)."""
    cfg, depth = INSTANCES["h2 FA2 M4"]
    rng = random.Random(22)
    named_workers = 0
    for s in list(_orbits(cfg, depth).values())[:1500]:
        blocks = list(range(1, cfg.num_blocks))
        rng.shuffle(blocks)
        t = rename(s, [0, *blocks], rng.sample(range(cfg.workers), cfg.workers))
        names = []
        for u in (s, t):
            _, lab, ren = canonical(u)
            named = {}
            for a in u.enabled():
                n = name(u, a, lab, ren)
                if n is not None:
                    assert n not in named, (n, a, named[n])  # one action per name
                    named[n] = a
            names.append(named)
        assert names[0].keys() == names[1].keys()
        for n, a in names[0].items():
            assert s.apply(a).fingerprint() == t.apply(names[1][n]).fingerprint(), a
            named_workers += a[0] in ("run_job", "report")
    assert named_workers > 100
