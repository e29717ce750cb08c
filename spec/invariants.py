"""The invariants of the spec, one named function each.

Each function takes a :class:`spec.model.State` and returns ``None`` when the invariant holds or
a short message naming the first offending block/key/request. ``ALL`` lists them in order; the
bounded checker, the hypothesis machines and the refinement check all run exactly this list.
The ids (I1..I21) are shared with the cases and tests; docs/spec.md, section 4, says what each
states and where the ones not listed here (I5, I13, I15, I16, I20, I21) are checked instead.
"""

from __future__ import annotations

from collections.abc import Callable

from .arithmetic import cdiv
from .model import FA, MAMBA, NULL, State, ck_int

Result = str | None


#: ``[state, its holders]`` while :func:`check` runs on that state (I1 and I3 both count them,
#: and no invariant changes the state), else ``[None, None]``
_HOLDERS: list = [None, None]


def holders(s: State) -> list[int]:
    """Holder count of every block: table entries (all groups, unfinished requests), CoW
    retentions (undrained copies and drained-unreleased handles, deferred request frees),
    pins of unreleased store jobs and the connector's turn-end snapshot blocks."""
    if _HOLDERS[0] is s:
        return _HOLDERS[1]
    cnt = [0] * s.cfg.num_blocks
    for r in s.reqs:
        if r.status != "finished":
            for b in r.fa + r.mamba:
                cnt[b] += 1
        if r.slot is not None:
            cnt[r.slot[0]] += 1
    for _, src, dst in s.pending_copies:
        cnt[src] += 1
        cnt[dst] += 1
    for _, ids, _ in s.retained:
        for b in ids:
            cnt[b] += 1
    for j in s.jobs.values():
        if not j.released:
            for b in j.ids:
                cnt[b] += 1
    return cnt


def i1_refcount_equals_holders(s: State) -> Result:
    """I1: ``ref_cnt == T + R + D + P`` for every non-null block. Rules out leaked refs (a block
    never returns to the pool) and lost refs (a held block reaches ref 0 and is reused: double
    free, dropped pin, early retention release)."""
    h = holders(s)
    for b in range(1, s.cfg.num_blocks):
        if s.ref[b] != h[b]:
            return f"block {b}: ref {s.ref[b]} != holders {h[b]}"
    return None


def i2_free_iff_unreferenced(s: State) -> Result:
    """I2: a non-null block is in the free queue iff its ref is 0, at most once; the null block
    never. Rules out handing out a referenced block and losing an unreferenced one."""
    if len(set(s.fq)) != len(s.fq) or NULL in s.fq:
        return "free queue has duplicates or the null block"
    inq = set(s.fq)
    for b in range(1, s.cfg.num_blocks):
        if (b in inq) != (s.ref[b] == 0):
            return f"block {b}: ref {s.ref[b]}, in free queue {b in inq}"
    return None


def i3_held_never_allocated(s: State) -> Result:
    """I3: ``get_new_blocks`` only pops ref-0 blocks, so retained and pinned blocks are never
    handed to another request (which would overwrite a CoW source/target or a pinned tail)."""
    if any(v.startswith("allocated held") for v in s.violations):
        return "a held block was allocated"
    h, inq = holders(s), set(s.fq)
    for b in range(1, s.cfg.num_blocks):
        if h[b] and b in inq:
            return f"held block {b} is in the free queue"
    return None


def i4_key_consistency(s: State) -> Result:
    """I4: every key maps to one non-null block, sits on an h-boundary of its prefix, and a Mamba
    key inside a block (sub-block tail) is exactly ck(P) of some prompt. Rules out keys left on
    the null block or at boundaries no lookup may ask for."""
    c = s.cfg
    for (g, p), b in s.keys.items():
        if b == NULL or not 0 < len(p) or len(p) % c.h:
            return f"key ({g},{len(p)}) on block {b}"
        if g == MAMBA and len(p) % c.bs_mamba and not any(
            q[: len(p)] == p and ck_int(len(q), c.h, c.use_eagle) == len(p)
            for q in c.prompts
        ):
            return f"Mamba sub-block key at {len(p)} is not a ck(P)"
    return None


def i6_ghost_content(s: State) -> Result:
    """I6: a key's block holds the bytes of that key's prefix wherever it can be read. Keys
    registered or moved in the current unexecuted step are exempt until it executes, but then a
    Mamba one must be in ``cached_blocks_this_step`` (same-step lookups are deferred). Every read
    so far (forward, copy source, store job) saw matching bytes."""
    reads = [v for v in s.violations if "read" in v]
    if reads:
        return reads[0]
    for k, b in s.keys.items():
        if k in s.fresh:
            if k[0] == MAMBA and k not in s.this_step:
                return f"fresh Mamba key {k[0]},{len(k[1])} not deferred"
        elif not s.key_valid(k, s.content[b]):
            return f"key ({k[0]},{len(k[1])}) on block {b} holds {s.content[b]}"
    return None


def i7_pinned_until_read(s: State) -> Result:
    """I7: from hand-off until every rank's store job ran and reported, each put block (the CoW
    target above all) keeps ref >= 1, so no allocation can reuse it before the job reads it."""
    for jid, j in s.jobs.items():
        if len(j.ran) < s.cfg.workers:
            for _, _, b in j.puts:
                if b != NULL and s.ref[b] < 1:
                    return f"job {jid}: put block {b} at ref 0 before the job read it"
    return None


def i8_retention_lifetime(s: State) -> Result:
    """I8: both endpoints of every undrained copy stay allocated; a deferred retention is not
    released before its fence step executed; a copy is drained exactly once. Rules out a CoW
    source or target being reused before the copy ran."""
    for _, src, dst in s.pending_copies:
        if s.ref[src] < 1 or s.ref[dst] < 1:
            return f"copy {src}->{dst} endpoint released before it ran"
    if set(s.pending_copies) & set(s.copies):
        return "a copy is both pending and drained"
    return None


def i9_hit_alignment(s: State) -> Result:
    """I9: a lookup returns ``hit % A == 0``, ``hit <= num_tokens - 1``, ``cdiv(hit, bs)``
    entries per group, and a Mamba state block keyed at exactly ``hit`` after null padding.
    Rules out hits no group can serve and recomputing nothing for the last token."""
    x, c = s.last_hit, s.cfg
    if x is None:
        return None
    if x.hit % c.A or x.hit > max(0, x.num_tokens - 1):
        return f"hit {x.hit} not A={c.A}-aligned below {x.num_tokens}"
    if len(x.fa) != cdiv(x.hit, c.bs_fa) or len(x.mamba) != cdiv(x.hit, c.bs_mamba):
        return f"hit {x.hit}: {len(x.fa)} FA / {len(x.mamba)} Mamba entries"
    if x.hit and (x.mamba[-1] == NULL or any(b != NULL for b in x.mamba[:-1])):
        return "Mamba hit entries are not [null..., state]"
    return None


def i10_joint_hit(s: State) -> Result:
    """I10: a hybrid hit at n needs every group at n: FA full blocks to ``floor(n/B)*B`` and,
    inside the next block, an entry keyed at some m in ``[n, block end]``; Mamba a state keyed at
    exactly n. Rules out serving a prefix one group cannot reconstruct."""
    x, c = s.last_hit, s.cfg
    if x is None or x.hit == 0:
        return None
    p = c.prompts[x.rid][: x.hit]
    full = [(FA, c.prompts[x.rid][: (i + 1) * c.bs_fa]) for i in range(x.hit // c.bs_fa)]
    if any(k not in x.keys for k in full):
        return f"hit {x.hit}: FA full blocks missing"
    if x.hit % c.bs_fa:
        end = cdiv(x.hit, c.bs_fa) * c.bs_fa
        if not any((FA, c.prompts[x.rid][:m]) in x.keys for m in range(x.hit, end + 1)):
            return f"hit {x.hit}: FA has no entry in the tail block"
    if (MAMBA, p) not in x.keys:
        return f"hit {x.hit}: Mamba has no state at the hit"
    return None


def i11_tail_registration(s: State) -> Result:
    """I11: a producer marker names the request's running block at exactly ck(P) (a sub-block
    boundary below P) and, once the registering step executed, that block holds the state at
    ck(P) (its key may since have been evicted, even re-registered elsewhere). A chunk sequence
    that crossed a sub-block ck(P) stopped at it (the scheduler split), so the tail is
    registered at all. Rules out handing off a block that holds some other state."""
    c = s.cfg
    for rid, r in enumerate(s.reqs):
        ck = ck_int(len(r.prompt), c.h, c.use_eagle)
        if r.marker is not None:
            src, n = r.marker
            if n != ck or n >= len(r.prompt) or n % c.bs_mamba == 0 or not r.mamba \
                    or src != r.mamba[-1]:
                return f"r{rid}: marker {r.marker} is not the tail at ck={ck}"
            if s.phase == "idle" and s.content[src] != (MAMBA, r.prompt[:n]):
                return f"r{rid}: marker block {src} holds {s.content[src]}"
        if r.stops and ck % c.bs_mamba and r.stops[0] < ck < r.computed and ck not in r.stops:
            return f"r{rid}: chunks {r.stops} skipped ck={ck}"
    return None


def i12_handoff_validity(s: State) -> Result:
    """I12: an undrained hand-off belongs to a live request and names a non-null block for its
    h-aligned boundary within its tokens: the table entry for an aligned snapshot, an off-table CoW
    target for a sub-block tail (decode-time boundaries are hand-offs too; the connector drops
    them). Rules out pinning/putting a freed or overwritten block."""
    c = s.cfg
    for rid, g, b, n in s.offloads:
        r = s.reqs[rid]
        if r.status != "running" or b == NULL or n % c.h or n > len(c.seq(rid)):
            return f"hand-off r{rid} {g}/{b}@{n} of a {r.status} request"
        if n % c.bs_mamba == 0 and r.mamba[n // c.bs_mamba - 1] != b:
            return f"hand-off r{rid} snapshot {b} is not table entry {n // c.bs_mamba - 1}"
        if n % c.bs_mamba and b in r.mamba:
            return f"hand-off r{rid} tail {b} is still in the table"
    return None


def i14_pin_exactness(s: State) -> Result:
    """I14: a store job pins each distinct non-null block once and releases exactly once, only
    after every rank reported (reports only from ranks that ran). Rules out unpinning while a
    rank still reads, pinning the null block, and double unpins."""
    for jid, j in s.jobs.items():
        if NULL in j.ids or len(set(j.ids)) != len(j.ids):
            return f"job {jid} pins {j.ids}"
        if j.released or not j.reported <= j.ran or len(j.reported) >= s.cfg.workers:
            return f"job {jid} released={j.released} with {len(j.reported)} reports"
    return None


def i17_fail_closed(s: State) -> Result:
    """I17: a store key exists only with the bytes of its prefix (puts that failed leave no key;
    a lookup miss is the only failure mode)."""
    for (rank, g, p), v in s.store.items():
        if not s.key_valid((g, p), v):
            return f"store key rank{rank} ({g},{len(p)}) holds {v}"
    return None


def i18_pressure_gate(s: State) -> Result:
    """I18: a request is in the skip set only while pressure is active (mark sets the flag
    first; the first full success clears both)."""
    if s.skip and not s.pressure:
        return f"skip set {sorted(s.skip)} without pressure"
    return None


def i19_reset_only_when_free(s: State) -> Result:
    """I19: ``reset_prefix_cache`` succeeds only when every non-null block is free (no table, no
    retention, no pin), so a reset never strips keys under a pinned or retained block."""
    if s.last_reset is not None and s.last_reset[0] and not s.last_reset[1]:
        return "reset succeeded with held blocks"
    if s.last_reset is not None and s.last_reset[0] and s.keys:
        return "reset left keys behind"
    return None


def i22_snapshot_content(s: State) -> Result:
    """I22 (turn-end extension, docs/reuse.md): between steps, a request's snapshot block holds
    exactly the Mamba state of the prefix its boundary names, and no request table holds it, so
    the flush at finish puts the bytes its key promises (with I17: no stale checkpoint read)."""
    if s.phase != "idle":
        return None
    tables = {b for r in s.reqs if r.status != "finished" for b in r.fa + r.mamba}
    for rid, r in enumerate(s.reqs):
        if r.slot is None:
            continue
        slot, n = r.slot
        if slot == NULL or slot in tables:
            return f"r{rid}: snapshot block {slot} is null or in a table"
        if s.content[slot] != (MAMBA, s.cfg.seq(rid)[:n]):
            return f"r{rid}: snapshot block {slot} at {n} holds {s.content[slot]}"
    return None


ALL: list[tuple[str, Callable[[State], Result]]] = [
    ("I1", i1_refcount_equals_holders),
    ("I2", i2_free_iff_unreferenced),
    ("I3", i3_held_never_allocated),
    ("I4", i4_key_consistency),
    ("I6", i6_ghost_content),
    ("I7", i7_pinned_until_read),
    ("I8", i8_retention_lifetime),
    ("I9", i9_hit_alignment),
    ("I10", i10_joint_hit),
    ("I11", i11_tail_registration),
    ("I12", i12_handoff_validity),
    ("I14", i14_pin_exactness),
    ("I17", i17_fail_closed),
    ("I18", i18_pressure_gate),
    ("I19", i19_reset_only_when_free),
    ("I22", i22_snapshot_content),
]


#: The invariants that read ``last_hit`` or ``last_reset``: the result of the action just taken,
#: which the state's fingerprint leaves out (every other invariant reads only fields in it).
TRANSIENT: frozenset[str] = frozenset({"I9", "I10", "I19"})


def check(s: State, only: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """Every violated invariant of ``s`` as ``(name, message)`` (those in ``only``, if given)."""
    fns = ALL if only is None else _subset(only)
    out = []
    if only is None or "I1" in only and "I3" in only:  # both count the holders: count once
        _HOLDERS[0], _HOLDERS[1] = s, holders(s)
    try:
        for name, fn in fns:
            msg = fn(s)
            if msg is not None:
                out.append((name, msg))
    finally:
        _HOLDERS[0] = _HOLDERS[1] = None
    return out


def _subset(only: frozenset[str]) -> list[tuple[str, Callable[[State], Result]]]:
    """The entries of :data:`ALL` named in ``only``, in order (memoised: the search asks for
    :data:`TRANSIENT` on every merged state)."""
    fns = _SUBSETS.get(only)
    if fns is None:
        fns = _SUBSETS[only] = [(n, fn) for n, fn in ALL if n in only]
    return fns


_SUBSETS: dict[frozenset[str], list[tuple[str, Callable[[State], Result]]]] = {}
