"""Sleep sets for the bounded search: which actions of the spec commute, and where.

The bounded search (:mod:`spec.proofs.bmc`) reaches many states twice along a *diamond*: a
worker rank's store step ``w`` (``run_job``, ``report``) and a step ``x`` (of the engine or
another rank) that neither reads nor writes what ``w`` touches reach ``s.x.w == s.w.x``.
Breadth-first, both corners are generated. A sleep set (Godefroid, "Partial-Order Methods for
the Verification of Concurrent Systems", LNCS 1032, 1996, ch. 5) skips the second: after
``s --w--> t``, the actions that were enumerated at ``s`` before ``w`` (or slept there) and
commute with ``w`` there *sleep* at ``t`` (``t.x`` is ``s.x.w``, reached through ``s.x``).
Sleep sets prune transitions, never states: the search visits exactly the states (orbits) it
visited without them, each at the same BFS depth, so the bound ``K`` and every state the
invariants are checked on are unchanged (``tests/spec/test_sleep.py`` compares the visited
states with a plain BFS's, per instance).

**Why no state is lost (BFS with merging, bounded depth).** ``sleep(t)`` is the intersection,
over every edge ``(s, a)`` from the previous layer that reaches ``t``'s orbit, of
``Z(s, a) = {x in sleep(s) or enumerated at s before a : x commutes with a at s}``; a sleeping
action is not explored. Take any orbit ``u`` at depth ``k <= K`` and, among the length-``k``
paths reaching it (all shortest, so the i-th state of each is at depth ``i``), the one whose
action sequence is lexicographically least (by each state's ``enabled()`` order). Suppose its
i-th action ``x`` sleeps at its (i-1)-th state ``q``. The path's edge into ``q`` is explored (by
induction on ``i``) and discovers ``q``, so ``x`` is in its ``Z``: ``x`` commutes with the
edge's action ``a`` at the state before, and comes there before ``a`` (then swapping
``a, x`` gives a lexicographically smaller path of the same length to ``u``) or slept there
(repeat one edge back; the initial state's sleep set is empty, so some earlier position gives the
smaller path). Either way a contradiction: every action of that path is explored, so ``u`` is
reached at depth ``k``. With the symmetry reduction (:mod:`spec.symmetry`) the same argument
runs on orbits; it needs a sleeping action to mean the same thing at every member of an orbit,
so a sleeping action is stored by a name that does (see **Names** below). Skipping a successor
that is its parent, its previous sibling or a rank-automorphic image of an earlier sibling
(:mod:`spec.proofs.bmc`) keeps the argument: such an action is never on the least path (an
earlier action, or none, reaches the same orbit).
A pruned transition's target is a state the search checks anyway; its transient result (the
lookup of ``schedule``, the outcome of ``reset``: invariants I9, I10, I19) equals the one of the
commuting edge that is explored, because the action it commutes with changes nothing they
read.

**The independence relation** (read/write sets of :mod:`spec.model`'s actions; a pair is
declared only where neither writes what the other reads or writes, or both only add to one set,
which gives the diamond, and neither disables the other). Worker actions at ``s``:

* ``run_job j r error``, a run_job of a job that is not live (its request was preempted since:
  epochs only grow) or whose puts this rank's store already holds (nothing removes a store
  entry), and a ``report j r`` that is not the job's last only add ``r`` to job ``j``'s ``ran``
  or ``reported``, now and after any other action; nothing but the same rank's alternatives on
  ``j`` reads those, so they commute with every other action (two reports of one job reach the
  same unpin in either order).
* any other ``run_job j r ok|full`` reads job ``j``, its request's ``generation``, ``pressure`` and
  ``skip``, the store and the ``content`` of its put blocks, and writes ``ran``, the store,
  ``pressure`` and ``skip``. No engine action reads or writes the store, ``pressure``, ``skip``
  or an existing job (new jobs are new keys); ``preempt`` writes an ``generation`` and ``execute``
  writes ``content``, so it commutes with every engine action but ``execute`` and a ``preempt``
  of its own request, and with the last report of another job (``ref``, the free queue,
  ``keys``). Two ``ok`` of different ranks, neither gated, commute (each stores on its own rank,
  both clear the pressure); two ``full`` commute (each sets the flag and adds its request to
  the skip set, whether gated or not: unions); an ``ok`` that is gated stays gated after a
  ``full``.
* the last ``report j r`` also unpins (``free_blocks``: ``ref``, the free queue; it reads the
  ``keys`` of the blocks it frees): it commutes with ``begin_step``, ``execute``, an ``evict`` of
  a block the job does not pin, and the worker actions above.
* engine actions: ``evict b`` and ``evict b'`` (``b != b'``) strip disjoint keys.

The reduction is used on the unmutated :class:`spec.model.State` only (a mutant overrides rules,
so its read/write sets are not these), and a test checks every declared pair on every state of a
bounded search of each instance of ``tailproof prove``: both orders reach the same state and
the same transient result, and each action stays enabled after the other.

**Names.** A sleeping action must mean the same at every member of an orbit, so it is stored
by a name built from the renaming that gave the state's fingerprint
(:func:`spec.symmetry.canonical`): an ``evict`` by the block's canonical id, a worker action by
its job's canonical form and the rank's canonical image (no name, so never asleep, when two of
the state's jobs have one canonical form); the other engine actions name no block, rank or job.
"""

from __future__ import annotations

from typing import Any

#: the worker ranks' actions: each names a job and a rank
WORKER = frozenset({"run_job", "report"})

#: engine actions that name no block, rank or job
_PLAIN = frozenset({"begin_step", "schedule", "preempt", "end_schedule", "execute", "finish",
                    "reset", "release"})
#: the engine actions a run_job ok/full commutes with (``preempt``: of another request)
_RUN_JOB = frozenset({"begin_step", "schedule", "end_schedule", "finish", "evict", "reset",
                      "release"})


def _kind(s: Any, a: tuple, memo: dict[tuple, str] | None = None) -> str:
    """A worker action's class at ``s``: ``add`` (only adds its rank to one of the job's sets,
    now and after any other action), ``ok``/``full`` (a run_job that stores or marks pressure),
    ``unpin`` (the job's last report). ``memo``: the classes already found at ``s`` (the search
    asks for each action's class once per state, not once per pair)."""
    if memo is not None:
        k = memo.get(a)
        if k is None:
            k = memo[a] = _kind(s, a)
        return k
    j = s.jobs[a[1]]
    if a[0] == "run_job":
        # error stores nothing; a job of an earlier generation stays not live (epochs only grow);
        # puts all stored already stay stored (nothing removes a store entry)
        if a[3] == "error" or s.reqs[j.rid].generation != j.generation or all(
                (a[2], g, p) in s.store for g, p, _ in j.puts):
            return "add"
        return a[3]
    return "add" if len(j.reported) + 1 < s.cfg.workers else "unpin"


def _gated(s: Any, a: tuple) -> bool:
    """The pressure gate skips this run_job at ``s`` (``_should_skip_request``)."""
    return s.pressure and s.jobs[a[1]].rid in s.skip


def commutes(s: Any, a: tuple, x: tuple, memo: dict[tuple, str] | None = None) -> bool:
    """Whether actions ``a`` and ``x`` (distinct, both enabled at ``s``) commute there
    (``s.a.x == s.x.a``, the same transient result, neither disables the other); ``memo`` as
    for :func:`_kind`."""
    wa, wx = a[0] in WORKER, x[0] in WORKER
    if not wa and not wx:
        return a[0] == x[0] == "evict"
    if not wa:
        a, x, wa, wx = x, a, wx, wa
    ka = _kind(s, a, memo)
    if wx:
        if a[1:3] == x[1:3]:
            return False  # one rank's alternatives on one job
        kx = _kind(s, x, memo)
        if ka == "add" or kx == "add":
            return True
        if ka == kx == "ok":  # each stores on its own rank; neither gated, both clear
            return a[2] != x[2] and not _gated(s, a) and not _gated(s, x)
        if ka == kx == "full":  # each sets the flag and adds its request: unions
            return True
        if {ka, kx} == {"ok", "full"}:  # a gated ok stays gated after a full
            return _gated(s, a if ka == "ok" else x)
        return ka != kx  # a put and another job's last report; never two unpins
    if ka == "add":
        return True
    if ka in ("ok", "full"):
        if x[0] == "preempt":
            return x[1] != s.jobs[a[1]].rid
        return x[0] in _RUN_JOB
    if x[0] == "evict":
        return x[1] not in s.jobs[a[1]].ids
    return x[0] in ("begin_step", "execute")


def name(s: Any, a: tuple, lab: list[int], ren: tuple[int, ...]) -> tuple | None:
    """``a``'s name at ``s``, the same at every state of its orbit (``lab``, ``ren``: the
    renaming of :func:`spec.symmetry.canonical`), or None (never asleep)."""
    return names(s, [a], lab, ren)[0]


def names(s: Any, acts: list[tuple], lab: list[int], ren: tuple[int, ...],
          jobs: list[tuple] | None = None) -> list[tuple | None]:
    """:func:`name` of each action of ``acts`` at ``s`` (the job forms computed once; ``jobs``:
    the jobs as :func:`spec.symmetry.canonical_jobs` gave them with ``lab``, if at hand)."""
    keys: dict[int, tuple | None] | None = None
    out: list[tuple | None] = []
    for a in acts:
        if a[0] in _PLAIN:
            out.append(a)
        elif a[0] == "evict":
            out.append(("evict", lab[a[1]]))
        else:
            if keys is None:
                keys = _job_keys(s, lab, ren) if jobs is None else job_keys(s, jobs, ren)
            key = keys.get(a[1])
            out.append(None if key is None else
                       (a[0], key, ren[1 << a[2]].bit_length() - 1, *a[3:]))
    return out


def _job_keys(s: Any, lab: list[int], ren: tuple[int, ...]) -> dict[int, tuple | None]:
    """Each job as the fingerprint shows it (blocks and rank sets renamed); None for a form
    two jobs share (the name would not say which)."""
    ex = s.executed
    jobs = [(j.rid, j.generation, tuple([lab[b] for b in j.ids]),
             tuple([(g, p, lab[b]) for g, p, b in j.puts]), ex - j.fence,
             _bits(j.ran), _bits(j.reported), j.released) for j in s.jobs.values()]
    return job_keys(s, jobs, ren)


def job_keys(s: Any, jobs: list[tuple], ren: tuple[int, ...]) -> dict[int, tuple | None]:
    """:func:`_job_keys` from the jobs with blocks renamed and rank sets as bitmasks, in
    ``s.jobs`` order (what :func:`spec.symmetry.canonical_jobs` builds on the way)."""
    out: dict[int, tuple | None] = {
        jid: (*k[:5], ren[k[5]], ren[k[6]], k[7]) for jid, k in zip(s.jobs, jobs, strict=True)}
    if len(set(out.values())) < len(out):
        seen: dict[tuple | None, int] = {}
        for k in out.values():
            seen[k] = seen.get(k, 0) + 1
        out = {jid: (k if seen[k] == 1 else None) for jid, k in out.items()}
    return out


def _bits(ranks: frozenset[int]) -> int:
    return sum(1 << r for r in ranks)


def passed_on(s: Any, a: tuple, asleep: list[tuple], before: list[tuple],
              memo: dict[tuple, str] | None = None) -> list[tuple]:
    """``Z(s, a)``: the actions that sleep at ``s.a`` (from this edge), concrete: those asleep
    at ``s`` or enumerated at ``s`` before ``a`` that commute with ``a`` there (``memo`` as for
    :func:`_kind`)."""
    return [x for x in (*asleep, *before) if commutes(s, a, x, memo)]
