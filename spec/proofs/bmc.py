"""Bounded model checking of :mod:`spec.model` by explicit-state breadth-first search.

Every state reachable in at most ``depth`` transitions from the initial state is generated
(duplicates merged by the canonical fingerprint) and every invariant of
:mod:`spec.invariants` is checked on it. A violation returns the shortest action sequence
that reaches it (BFS order), ready to be exported as a trace. When the frontier empties before
the bound, the reachable state space of that instance is exhausted and the invariants hold at
every depth for it (reported as ``closed``).

Transitions, never states, are pruned: sleep sets skip one order of two commuting actions
(:mod:`spec.proofs.sleep`, with why every state within the bound is still reached), a rank
permutation that fixes a state takes only the first of two symmetric worker steps, and a
successor equal to its parent or previous sibling is not hashed again (its transient result is
still checked). The states new in the last layer are checked and counted but not kept (they are
never expanded), and the kept fingerprints share their equal parts: most of a search's memory.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..invariants import TRANSIENT, check
from ..model import Config, State
from ..symmetry import (
    canonical_after_worker_step,
    canonical_jobs,
    rank_automorphisms,
    rename_ranks,
)
from .sleep import WORKER, passed_on
from .sleep import names as action_names


@dataclass
class BmcResult:
    """Outcome of one bounded search."""

    ok: bool
    depth_reached: int
    states: int
    closed: bool  # the frontier emptied: no new state at any depth
    seconds: float
    violation: tuple[str, str] | None = None
    trace: list[tuple] | None = None
    coverage: dict[str, int] = field(default_factory=dict)


def _events(s: State, act: tuple, t: State) -> list[str]:
    """What a new state witnesses, so a passing search can show it was not vacuous."""
    out = [f"{'fa' if g == 0 else 'mamba'}_cow_queued" for g, _, _ in t.pending_copies[:1]]
    if act[0] == "schedule" and t.last_hit is not None and t.last_hit.hit:
        out.append("subblock_hit" if t.last_hit.hit % s.cfg.bs_mamba else "aligned_hit")
    if act[0] == "schedule" and t.offloads and len(t.offloads) > len(s.offloads):
        out.append("handoff")
    if act[0] == "finish" and len(t.jobs) > len(s.jobs):
        out.append("finish_handoff_pinned")
    if act[0] == "end_schedule" and t.snapshots:
        out.append("snapshot_taken")
    if act[0] == "end_schedule" and any(
            g == 1 and len(p) > s.ck(len(s.cfg.prompts[j.rid])) and len(p) != s.cfg.junction(j.rid)
            for jid, j in t.jobs.items() if jid not in s.jobs for g, p, _ in j.puts):
        out.append("turn_end_flushed_at_last_boundary")
    if act[0] == "finish" and any(
            g == 1 and len(p) > s.ck(len(s.cfg.prompts[j.rid]))
            for jid, j in t.jobs.items() if jid not in s.jobs for g, p, _ in j.puts):
        out.append("turn_end_flushed")
    if act[0] == "run_job" and any(
            g == 1 and len(p) == s.cfg.junction(s.jobs[act[1]].rid)
            for (_, g, p) in set(t.store) - set(s.store)):
        out.append("junction_put")
    if act[0] == "run_job" and s.cfg.decode_checkpoints and any(
            g == 1 and len(p) > len(s.cfg.prompts[s.jobs[act[1]].rid])
            for (_, g, p) in set(t.store) - set(s.store)):
        out.append("decode_checkpoint_put")
    if act[0] == "report" and len(t.jobs) < len(s.jobs):
        out.append("job_unpinned")
    if act[0] == "run_job" and len(t.store) > len(s.store):
        out.append("store_put")
    if act[0] == "run_job" and t.pressure and not s.pressure:
        out.append("pressure_marked")
    if act[0] == "reset" and t.last_reset and t.last_reset[0]:
        out.append("reset_ok")
    if act[0] == "evict":
        out.append("evict")
    return out


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: states hold no reference cycles (reference counting
    frees them), and with 10^5 fingerprints alive its full passes cost most of a search's time
    (measured: ``apply`` 5x and ``fingerprint`` 1.8x slower with it on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def bmc(cfg: Config, depth: int, max_states: int = 2_000_000,
        deadline_s: float | None = None, model: type[State] = State,
        symmetry: bool = True, sleep: bool = True) -> BmcResult:
    """Search every state of ``model`` (the spec, or a mutant of it) within ``depth`` steps;
    stop at the first invariant violation. ``symmetry`` merges states equal up to block and
    rank renaming (:mod:`spec.symmetry`); off, only identical states merge. ``sleep`` skips
    transitions whose target a commuting edge reaches (:mod:`spec.proofs.sleep`: the same
    states, fewer transitions); it applies to the unmutated model only, so a mutant's search
    and counterexample are those of the plain search."""
    with _no_cyclic_gc():
        return _search(cfg, depth, max_states, deadline_s, model, symmetry,
                       sleep and model is State)


def _search(cfg: Config, depth: int, max_states: int, deadline_s: float | None,
            model: type[State], symmetry: bool, sleepy: bool) -> BmcResult:
    t0 = time.monotonic()
    s0 = model(cfg)
    f0, lab0, ren0, jobs0 = canonical_jobs(s0, symmetry)
    run = _Search(model, symmetry, sleepy, t0, f0)
    # (state, fingerprint, names of the actions asleep there, its renaming, its jobs renamed)
    frontier: list[_Entry] = [(s0, f0, run.none, lab0, ren0, jobs0)]
    bad = check(s0)
    if bad:
        return BmcResult(False, 0, 1, False, time.monotonic() - t0, bad[0], [])
    d = 0
    while frontier and d < depth:
        d += 1
        # the states new in the last layer are checked but never expanded: they are not kept
        # (most of the memory), nor are their sleep sets computed; ``grew`` says the frontier
        # would not have emptied
        nxt: list[_Entry] = []
        layer: dict[tuple, int] = {}  # states new in this layer -> index in nxt
        for entry in frontier:
            found = run.expand(entry, d, d == depth, nxt, layer)
            if found is not None:
                return found
            if len(run.parent) > max_states or (deadline_s and time.monotonic() - t0
                                                > deadline_s):
                return BmcResult(True, d - 1, len(run.parent), False, time.monotonic() - t0,
                                 coverage=dict(run.cov))
        frontier = nxt
    return BmcResult(True, d, len(run.parent), not (frontier or run.grew),
                     time.monotonic() - t0, coverage=dict(run.cov))


class _Search:
    """The state of one bounded search: every state seen, with the edge it was first reached
    by (``parent``: counterexample paths), the coverage counted, and whether the last layer
    found a new state (``grew``)."""

    def __init__(self, model: type[State], symmetry: bool, sleepy: bool, t0: float,
                 f0: tuple) -> None:
        self.symmetry = symmetry
        self.sleepy = sleepy
        self.t0 = t0
        self.plain = model is State  # unmodified: a worker step's hash is rebuilt from its parent's
        self.parent: dict[tuple, tuple[tuple, tuple] | None] = {f0: None}
        self.none: frozenset[tuple] = frozenset()
        self.cov: Counter[str] = Counter()
        # one copy of each distinct fingerprint part (most states share their tables, keys,
        # refs with many others): the kept fingerprints are most of a search's memory
        self.share = {}.setdefault
        self.grew = False  # the last layer has a new state (it is not kept)

    def _violation(self, d: int, fp: tuple, act: tuple, why: str) -> BmcResult:
        return BmcResult(False, d, len(self.parent), False, time.monotonic() - self.t0, why,
                         _path(self.parent, fp) + [act])

    def expand(self, entry: _Entry, d: int, last: bool, nxt: list[_Entry],
               layer: dict[tuple, int]) -> BmcResult | None:
        """Every successor of one frontier state, checked; the new ones join ``nxt`` (unless
        ``last``). A violation is returned with its path."""
        s, fp, names, lab, ren, jobs = entry
        symmetry, sleepy, parent = self.symmetry, self.sleepy, self.parent
        acts = s.enabled()
        asleep = []
        if names:
            asleep = [a for a, n in zip(acts, action_names(s, acts, lab, ren, jobs),
                                        strict=True) if n in names]
        before: list[tuple] = []  # the actions enumerated at s so far
        kinds: dict[tuple, str] = {}  # the sleep sets' class of each worker action at s
        autos = rank_automorphisms(s) if symmetry else []
        done: set[tuple] = set()  # actions taken at s (for the rank automorphisms)
        prev: State = s
        for act in acts:
            if asleep and act in asleep:
                continue
            if sleepy:
                before.append(act)
            if autos and any(rename_ranks(act, rho) in done for rho in autos):
                continue  # s is fixed by rho: this successor is rho(an earlier one)
            done.add(act)
            t = s.apply(act)
            if same_state(t, s) or same_state(t, prev):
                # a self-loop or an earlier sibling's state: seen; only its transient part
                # (the lookup or reset just taken) is new
                prev = t
                bad = check(t, TRANSIENT)
                if bad:
                    return self._violation(d, fp, act, bad[0])
                continue
            prev = t
            hashed = canonical_after_worker_step(s, fp, lab, jobs, t, act, symmetry) \
                if self.plain and act[0] in WORKER else None
            tf, tlab, tren, tjobs = hashed or canonical_jobs(t, symmetry)
            seen = tf in parent
            # A state merged with one already checked differs from it only by a renaming
            # and in the fields the fingerprint leaves out: re-check just those.
            bad = check(t, TRANSIENT if seen else None)
            if bad:
                parent.setdefault(tf, (fp, act))
                return self._violation(d, fp, act, bad[0])
            if not seen:
                tf = tuple(map(self.share, tf, tf))  # its parts: one copy of each equal one
                parent[tf] = (fp, act)
                self.cov.update(_events(s, act, t))
                if last:  # checked and counted; never expanded, so not kept
                    self.grew = True
                    continue
                layer[tf] = len(nxt)
                z = _asleep_after(s, act, asleep, before, t, tlab, tren, tjobs, kinds) \
                    if sleepy else self.none
                nxt.append((t, tf, z, tlab, tren, tjobs))
            elif tf in layer:  # another edge into a state new in this layer
                i = layer[tf]
                u, uf, uz, ulab, uren, ujobs = nxt[i]
                if uz:
                    z = _asleep_after(s, act, asleep, before, t, tlab, tren, tjobs, kinds)
                    nxt[i] = (u, uf, uz & z, ulab, uren, ujobs)
        return None


#: a frontier entry: (state, fingerprint, names asleep there, its renaming ``lab``/``ren``, its
#: jobs relabelled, as :func:`spec.symmetry.canonical_jobs` gives them)
_Entry = tuple[State, tuple, frozenset, list[int], tuple[int, ...], list[tuple]]


def _asleep_after(s: State, act: tuple, asleep: list[tuple], before: list[tuple], t: State,
                  lab: list[int], ren: tuple[int, ...], jobs: list[tuple],
                  kinds: dict[tuple, str]) -> frozenset:
    """The names, at ``t = s.act``, of the actions this edge puts to sleep there (``before``:
    the actions enumerated at ``s`` up to ``act``, which is its last)."""
    z = passed_on(s, act, asleep, before[:-1], kinds)
    if not z:
        return frozenset()
    out = set(action_names(t, z, lab, ren, jobs))
    out.discard(None)
    return frozenset(out)


#: the fields a state's successor never inherits (``clone`` drops them): the result of the
#: action just taken
_TRANSIENT_FIELDS = frozenset({"last_hit", "last_reset"})


def same_state(t: State, u: State) -> bool:
    """Whether ``t`` and ``u`` are the same state but for the transient fields: every other
    field equal (the fingerprint reads only those), so ``t`` is merged with ``u``. The fields
    an action most often changes are compared first, so most answers are a quick no."""
    dt, du = t.__dict__, u.__dict__
    if len(dt) != len(du):
        return False
    for k in _FIRST:
        if dt[k] != du[k]:
            return False
    for k, v in dt.items():
        w = du.get(k, _MISSING)
        if v is not w and v != w and k not in _TRANSIENT_FIELDS:
            return False
    return True


#: compared first by :func:`same_state` (cheap, and changed by most actions)
_FIRST = ("phase", "step", "next_job", "pressure", "ref", "fq", "jobs")
_MISSING = object()


def _path(parent: dict, fp: tuple) -> list[tuple]:
    out: list[tuple] = []
    while parent[fp] is not None:
        fp, act = parent[fp]
        out.append(act)
    return out[::-1]


def replay(cfg: Config, actions: list[tuple], model: type[State] = State
           ) -> tuple[State, list[tuple[str, str]]]:
    """Run an action sequence from the initial state of ``model``; return the final state and
    the violations seen along the way (first state that violates)."""
    s = model(cfg)
    for act in actions:
        s = s.apply(act)
        bad = check(s)
        if bad:
            return s, bad
    return s, []
