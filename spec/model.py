"""Executable spec of block refcounts, CoW retention, store-job pins and boundary alignment.
One module (over 600 lines) on purpose: the whole state and every guarded action read top to
bottom, as a TLA+ spec does; invariants, arithmetic and proofs are modules of their own.

A deliberately small model of vLLM 0.33's scheduler-side block lifecycle for one hybrid model
(group 0 full attention, group 1 Mamba ``align``) plus the MooncakeStore connector's pins and
boundary puts. It states *what must be accounted for*, not how vLLM lays out its lists:

* blocks ``1..N-1`` with ``ref`` counts and a free queue (block 0 is the null block);
* holders: request tables per group, CoW retentions (pending copies and drained-unreleased
  handles), deferred request frees, connector store-job pins;
* prefix-cache keys ``(group, prefix) -> block``; the hash chain is modelled by the prefix itself;
* a ghost ``content[b] = (group, prefix)`` naming the prefix whose KV/state the block's bytes hold.
  Forward passes and copies write it (in GPU stream order: a step's copies, then its forward);
  lookups, forward passes and store jobs read it, and every read is checked against its key;
* boundary-state hand-offs (``take_boundary_state_offloads``), their consumption by the connector
  (store jobs that pin, put, are reported by every worker rank and then unpin);
* the boundary arithmetic of :mod:`spec.arithmetic` (the functions the reference also runs).

The records a state holds (:class:`Config`, requests, store jobs, the last lookup) are in
:mod:`spec.records`. Transitions are methods named after the vLLM function they abstract.
``enabled()`` lists every action of a state; ``apply()`` runs one on a copy. The rules that a
seeded bug changes are small methods of their own (each one step of a vLLM function), so the
proofs can seed a bug by overriding one of them in a subclass and show that the checkers have
teeth.
"""

from __future__ import annotations

from . import symmetry
from .arithmetic import (
    cdiv,
    clip_joint_hit,
    fine_grained,
    round_down,
    snapshot_due,
    tail_put_range,
)
from .records import FA, MAMBA, NULL, Config, Hit, Key, Put, Req, StoreJob, ck_int

__all__ = ["FA", "MAMBA", "NULL", "Config", "Hit", "StoreJob", "Key", "NoBlocks", "Put", "Req",
           "State", "ck_int", "initial"]


class NoBlocks(Exception):
    """``get_new_blocks`` asked for more blocks than are free (allocate_slots returns None)."""


class State:
    """A model state; ``apply`` returns a successor, never mutating ``self``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        n = cfg.num_blocks
        self.ref = [0] * n
        self.fq = list(range(1, n))
        self.keys: dict[Key, int] = {}
        self.content: list[Key | None] = [None] * n
        self.reqs = [Req(p) for p in cfg.prompts]
        self.pending_copies: list[tuple[int, int, int]] = []  # (group, src, dst), undrained
        self.retained: list[tuple[int, tuple[int, ...], str]] = []  # (fence, ids, cow|req)
        self.offloads: list[tuple[int, int, int, int]] = []  # (rid, group, block, boundary)
        self.jobs: dict[int, StoreJob] = {}
        self.next_job = 0
        self.store: dict[tuple[int, int, tuple[int, ...]], Key | None] = {}  # (rank, g, p)
        self.pressure = False
        self.skip: frozenset[int] = frozenset()
        self.phase = "idle"  # idle | sched | exec
        self.step = 0  # steps scheduled
        self.executed = 0  # steps whose copies + forward ran
        self.this_step: set[Key] = set()  # Mamba cached_blocks_this_step
        self.fresh: set[Key] = set()  # keys whose bytes arrive with the unexecuted step
        self.scheduled: dict[int, int] = {}  # rid -> chunk start, this step
        self.copies: list[tuple[int, int, int]] = []  # drained copies of the unexecuted step
        # turn-end snapshots of the unexecuted step: (rid, running block, slot block, boundary)
        self.snapshots: list[tuple[int, int, int, int]] = []
        self.violations: tuple[str, ...] = ()  # ghost reads that saw the wrong bytes, etc.
        self.last_hit: Hit | None = None
        self.last_reset: tuple[bool, bool] | None = None  # (succeeded, all blocks were free)

    # ----------------------------------------------------------------- plumbing
    def clone(self) -> State:
        s = self.__class__.__new__(self.__class__)
        s.__dict__.update(self.__dict__)
        s.ref, s.fq, s.content = list(self.ref), list(self.fq), list(self.content)
        s.keys, s.store, s.jobs = dict(self.keys), dict(self.store), dict(self.jobs)
        s.reqs = [r.clone() for r in self.reqs]
        s.pending_copies, s.retained = list(self.pending_copies), list(self.retained)
        s.offloads, s.copies = list(self.offloads), list(self.copies)
        s.snapshots = list(self.snapshots)
        s.this_step, s.fresh = set(self.this_step), set(self.fresh)
        s.scheduled = dict(self.scheduled)
        s.last_hit, s.last_reset = None, None
        return s

    def fingerprint(self, reduce: bool = True) -> tuple:
        """Canonical value for state-space search (:mod:`spec.symmetry`): block ids and worker
        ranks up to renaming, job ids and step numbers made relative."""
        return symmetry.fingerprint(self, reduce)

    def extra_blocks(self) -> tuple[int, ...]:
        """Blocks named by fields a subclass adds (a mutant's), for the canonical walk."""
        return ()

    def extra_fingerprint(self, lab: list[int]) -> tuple:
        """Fields a subclass adds, block ids renamed by ``lab`` (:mod:`spec.symmetry`)."""
        return ()

    def bad(self, msg: str) -> None:
        self.violations = self.violations + (msg,)

    def block_keys(self, b: int) -> list[Key]:
        return [k for k, v in self.keys.items() if v == b]

    # ----------------------------------------------------------------- block pool
    def touch(self, b: int) -> None:
        """``BlockPool.touch``: one more holder; leaves the free queue at ref 0 -> 1."""
        if b == NULL:
            return
        if self.ref[b] == 0:
            self.fq.remove(b)
        self.ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """``BlockPool.get_new_blocks``: pop n from the front, strip their keys, ref 1."""
        if n > len(self.fq):
            raise NoBlocks
        out, self.fq = self.fq[:n], self.fq[n:]
        for b in out:
            for k in self.block_keys(b):
                del self.keys[k]
            if self.ref[b] != 0:
                self.bad(f"allocated held block {b}")
            self.ref[b] = 1
        return out

    def free_blocks(self, ids: list[int] | tuple[int, ...]) -> None:
        """``BlockPool.free_blocks``: one holder fewer; at ref 0 unhashed blocks go to the front
        (reused first) and hashed ones to the LRU tail."""
        front, tail = [], []
        for b in ids:
            if b == NULL:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (tail if self.block_keys(b) else front).append(b)
        self.fq = front + self.fq + tail

    def register(self, key: Key, b: int, deferred: bool) -> bool:
        """``cache_full_blocks`` / ``cache_partial_block``: add key -> b unless present."""
        if key in self.keys or b == NULL:
            return False
        self.keys[key] = b
        self.fresh.add(key)
        if deferred:
            self.this_step.add(key)
        return True

    # ----------------------------------------------------------------- single rules
    def ck(self, p: int) -> int:
        """ck(P): where a sub-block tail sits (``get_mamba_prefill_checkpoint_position``)."""
        return ck_int(p, self.cfg.h, self.cfg.use_eagle)

    def hit_limit(self, num_tokens: int) -> int:
        """``max_cache_hit_length = num_tokens - 1`` floored to A (``get_computed_blocks``)."""
        return round_down(num_tokens - 1, self.cfg.A)

    def clip_fa(self, blocks: list[int], hit: int) -> list[int]:
        """FA keeps ``cdiv(hit, B)`` blocks of the joint hit (``find_longest_cache_hit``)."""
        return blocks[: cdiv(hit, self.cfg.bs_fa)]

    def deferred(self, key: Key) -> bool:
        """A Mamba key registered or moved this step is not hit in it: its bytes arrive with the
        step (``MambaManager.cached_blocks_this_step``)."""
        return key in self.this_step

    def queue_copy(self, g: int, src: int, dst: int) -> None:
        """Queue a CoW copy; both endpoints are already retained (``_pending_cow_copies``)."""
        self.pending_copies.append((g, src, dst))

    def release_copies(self, ids: tuple[int, ...]) -> None:
        """``Scheduler._free_cow_retained_blocks``: release drained copies' retention now, or
        after the step executed (``defer_block_free``)."""
        if self.cfg.defer_block_free:
            self.retained.append((self.step, ids, "cow"))
        else:
            self.free_blocks(ids)

    def move_block_hashes(self, src: int, dst: int) -> None:
        """``BlockPool.move_block_hashes``: the running CoW target takes the source's keys."""
        for k in self.block_keys(src):
            self.keys[k] = dst
            self.this_step.add(k)
            self.fresh.add(k)

    def drop_handoffs(self, rid: int) -> None:
        """``MambaManager.pop_blocks_for_free``: a freed request's undrained hand-offs go."""
        self.offloads = [o for o in self.offloads if o[0] != rid]

    def pop_tables(self, r: Req) -> list[int]:
        """Empty a request's tables; their blocks, in free order (each table reversed)."""
        ids = list(reversed(r.fa)) + list(reversed(r.mamba))
        r.fa, r.mamba = [], []
        return ids

    def job_blocks(self, r: Req, puts: list[Put], n: int) -> list[int]:
        """The distinct blocks a store job pins: its put blocks, once each
        (``_reference_save_blocks``, ``dict.fromkeys``)."""
        return list(dict.fromkeys(pb for _, _, pb in puts))

    def pin(self, ids: list[int]) -> None:
        """``pool.touch`` of a store job's blocks."""
        for b in ids:
            self.touch(b)

    def mark_pressure(self, rid: int, rank: int, keys: list[Put]) -> None:
        """``_mark_request_skipped_for_pressure`` after a -200 put: flag, then the request; the
        failed ``keys`` stay absent."""
        self.pressure = True
        self.skip = self.skip | {rid}

    def unpins(self, j: StoreJob) -> bool:
        """``update_connector_output``: a job unpins when every rank has reported."""
        return len(j.reported) == self.cfg.workers

    # ----------------------------------------------------------------- lookup (read)
    def lookup(self, rid: int) -> Hit:
        """``HybridKVCacheCoordinator.find_longest_cache_hit`` for a simple hybrid (FA, Mamba):
        FA full blocks then interior h-boundaries; Mamba right-to-left h-boundaries; the joint
        hit is the minimum; FA is clipped to ``cdiv(hit, bs_fa)`` blocks. Pure."""
        c, p = self.cfg, self.reqs[rid].prompt
        n_hashes = len(p) // c.h
        cap = len(p) - 1  # max_cache_hit_length: the last token is always recomputed
        lim = min(self.hit_limit(len(p)), n_hashes * c.h)
        fa_blocks: list[int] = []
        while (len(fa_blocks) + 1) * c.bs_fa <= lim:
            b = self.keys.get((FA, p[: (len(fa_blocks) + 1) * c.bs_fa]))
            if b is None:
                break
            fa_blocks.append(b)
        hit_fa = len(fa_blocks) * c.bs_fa
        if fine_grained(c.bs_fa, c.A):  # interior h-boundaries of the next block
            top = min(hit_fa + c.bs_fa - c.h, round_down(lim, c.h))
            for n in range(top, hit_fa, -c.h):
                b = self.keys.get((FA, p[:n]))
                if b is not None:
                    fa_blocks.append(b)
                    hit_fa = n
                    break
        hit_m, m_block = 0, NULL
        for n in range(round_down(min(lim, hit_fa), c.h), 0, -c.h):
            b = self.keys.get((MAMBA, p[:n]))
            if b is not None:
                hit_m, m_block = n, b
                break
        hit = clip_joint_hit(cap, [hit_fa, hit_m])
        fa_blocks = self.clip_fa(fa_blocks, hit)
        mamba = [NULL] * (cdiv(hit, c.bs_mamba) - 1) + [m_block] if hit else []
        return Hit(rid, len(p), hit, tuple(fa_blocks), tuple(mamba), frozenset(self.keys))

    def next_stop(self, rid: int, start: int) -> int:
        """``Scheduler._mamba_block_aligned_split``: stop at the next lcm boundary, at ck(P)
        when the chunk crosses it, and at the prompt end."""
        c, p = self.cfg, len(self.reqs[rid].prompt)
        if start >= p:  # decode: one token per step
            return start + 1
        stop = min(round_down(start, c.lcm) + c.lcm, p)
        ck = self.ck(p)
        if start < ck < stop:
            stop = ck
        j = c.junction(rid)  # the exact junction stop (the scheduler hook, docs/junctions.md)
        if start < j < stop:
            stop = j
        return stop

    # ----------------------------------------------------------------- transitions
    def enabled(self) -> list[tuple]:
        """Every action of this state, as hashable tuples ``(name, *args)``."""
        acts: list[tuple] = []
        c = self.cfg
        if self.phase == "idle":
            acts.append(("begin_step",))
            acts += [("finish", i) for i, r in enumerate(self.reqs) if r.status == "running"]
            acts += sorted({("evict", b) for b in self.keys.values()})
            acts.append(("reset",))
            acts += [("release", i) for i, (f, _, _) in enumerate(self.retained)
                     if f <= self.executed]
        elif self.phase == "sched":
            for i, r in enumerate(self.reqs):
                if i in self.scheduled or r.status == "finished":
                    continue
                if r.status == "waiting" or r.computed < len(c.seq(i)):
                    acts.append(("schedule", i))
            # FCFS preempts the running queue's tail (not yet scheduled this step); the PRIORITY
            # policy may preempt a request whose chunk was already scheduled (Scheduler.schedule,
            # SC:944-966)
            acts += [("preempt", i) for i, r in enumerate(self.reqs) if r.status == "running"
                     and (c.priority_preempt or i not in self.scheduled)]
            acts.append(("end_schedule",))
        else:
            acts.append(("execute",))
        for jid, j in sorted(self.jobs.items()):
            if j.fence <= self.executed:
                for rank in range(c.workers):
                    if rank not in j.ran:
                        acts += [("run_job", jid, rank, o) for o in c.outcomes]
                    elif rank not in j.reported:
                        acts.append(("report", jid, rank))
        return acts

    def apply(self, act: tuple) -> State:
        s = self.clone()
        getattr(s, "do_" + act[0])(*act[1:])
        return s

    def do_begin_step(self) -> None:
        """``KVCacheManager.new_step_starts``: a new scheduling pass."""
        self.phase, self.step = "sched", self.step + 1
        self.this_step.clear()
        self.scheduled.clear()

    def do_schedule(self, rid: int) -> None:
        """One ``allocate_slots`` of a scheduler-split chunk (+ ``cache_blocks``). A waiting
        request first adopts its local hit (touch, first-allocation CoW); a running one may do
        the running CoW of its own registered tail. Fails atomically (``None``) when short of
        blocks or when the Mamba hit was registered this step."""
        r = self.reqs[rid]
        backup = self.clone()
        try:
            if r.status == "waiting":
                self._first_alloc(rid)
            else:
                self._continue(rid)
        except NoBlocks:
            keep_hit = self.last_hit
            self.__dict__.update(backup.__dict__)
            self.last_hit = keep_hit
        self.scheduled.setdefault(rid, self.reqs[rid].computed)

    def _first_alloc(self, rid: int) -> None:
        c, r = self.cfg, self.reqs[rid]
        hit = self.lookup(rid)
        self.last_hit = hit
        n = hit.hit
        if n and self.deferred((MAMBA, r.prompt[:n])):
            raise NoBlocks  # get_num_blocks_to_allocate answers num_gpu_blocks + 1
        e = self.next_stop(rid, n)
        need = max(0, cdiv(e, c.bs_fa) - len(hit.fa)) + (1 if n % c.bs_fa else 0) + 1
        need += len({b for b in hit.fa + hit.mamba if b != NULL and self.ref[b] == 0})
        if need > len(self.fq):
            raise NoBlocks
        for b in hit.fa + hit.mamba:  # add_local_computed_blocks: touch every hit block
            self.touch(b)
        r.fa, r.mamba = list(hit.fa), list(hit.mamba)
        if n % c.bs_fa:
            self._apply_cow(r.fa, n // c.bs_fa, FA)
        r.fa += self.get_new_blocks(max(0, cdiv(e, c.bs_fa) - len(r.fa)))
        if n % c.bs_mamba:
            self._apply_cow(r.mamba, len(r.mamba) - 1, MAMBA)  # first-allocation CoW
        else:
            r.mamba += self.get_new_blocks(1)
        r.status, r.computed, r.stops = "running", n, (n,)
        self._forward(rid, n, e)

    def _apply_cow(self, table: list[int], idx: int, g: int) -> None:
        """``_apply_cow``: a private target replaces the shared hit block; the copy is queued and
        both endpoints are retained (source by its hit ref, target by an extra ref)."""
        src = table[idx]
        cow = self.get_new_blocks(1)[0]
        table[idx] = cow
        self.ref[cow] += 1
        self.queue_copy(g, src, cow)

    def _continue(self, rid: int) -> None:
        c, r = self.cfg, self.reqs[rid]
        s = r.computed
        e = self.next_stop(rid, s)
        cow_needed = r.marker is not None and r.marker[1] == s
        need = cdiv(e, c.bs_fa) - len(r.fa) + (1 if cow_needed or s % c.bs_mamba == 0 else 0)
        if need > len(self.fq):
            raise NoBlocks
        for i in range(len(r.mamba) - 1):  # remove_skipped_blocks: retire old Mamba states
            if r.mamba[i] != NULL:
                self.free_blocks([r.mamba[i]])
                r.mamba[i] = NULL
        r.fa += self.get_new_blocks(cdiv(e, c.bs_fa) - len(r.fa))
        if cow_needed:  # running CoW (MambaManager.allocate_new_blocks, case b)
            assert r.marker is not None
            src, n = r.marker
            cow = self.get_new_blocks(1)[0]
            self.move_block_hashes(src, cow)
            self.ref[src] += 1
            self.queue_copy(MAMBA, src, cow)
            self.offloads.append((rid, MAMBA, cow, n))
            r.marker = None
        elif s % c.bs_mamba == 0:
            r.mamba += self.get_new_blocks(1)
        self._forward(rid, s, e)

    def _forward(self, rid: int, s: int, e: int) -> None:
        """Commit the chunk ``[s, e)`` and run ``cache_blocks`` for it (registration happens at
        schedule time; the bytes arrive when the step executes)."""
        c, r = self.cfg, self.reqs[rid]
        r.computed, r.stops = e, r.stops + (e,)
        self.scheduled[rid] = s
        p, n_prompt = c.seq(rid), len(r.prompt)
        for i in range(e // c.bs_fa):  # FA full blocks
            self.register((FA, p[: (i + 1) * c.bs_fa]), r.fa[i], False)
        b = round_down(n_prompt if c.use_eagle else n_prompt - 1, c.h)  # FA partial tail
        if 0 < b <= e and b % c.bs_fa:
            self.register((FA, p[:b]), r.fa[b // c.bs_fa], False)
        run = r.mamba[-1]
        if e % c.bs_mamba == 0:  # aligned snapshot: registered, then a hand-off
            if self.register((MAMBA, p[:e]), run, True):
                self.offloads.append((rid, MAMBA, run, e))
        elif e == self.ck(n_prompt) and e % c.h == 0:  # sub-block producer tail
            if self.register((MAMBA, p[:e]), run, True):
                r.marker = (run, e)

    def do_preempt(self, rid: int) -> None:
        """``Scheduler._preempt_request``: free the tables (``pop_blocks_for_free`` also drops
        the request's undrained hand-offs), restart from 0, no finalize."""
        r = self.reqs[rid]
        self.scheduled[rid] = 0  # dropped from this step's batch, not rescheduled in it
        self.drop_handoffs(rid)
        self.free_blocks(self.pop_tables(r))
        self.release_slot(r)
        r.status, r.computed, r.marker, r.stops = "waiting", 0, None, ()
        r.generation += 1

    def do_end_schedule(self) -> None:
        """End of ``Scheduler.schedule``: drain hand-offs (step 4), drain copies and release or
        defer their retention (step 6), then the connector pins (step 7, ``build_connector_meta``).
        No allocation runs between 6 and 7 (I7's window)."""
        offloads, self.offloads = self.offloads, []
        self.copies, self.pending_copies = list(self.pending_copies), []
        ids = tuple(b for _, src, dst in self.copies for b in (src, dst))
        if ids:
            self.release_copies(ids)
        for rid, g, b, n in offloads:
            self._handoff(rid, g, b, n, self.step)
        if self.cfg.turn_end:
            for rid in sorted(self.scheduled):
                self._snapshot(rid)
        for rid in sorted(self.scheduled):
            self._junction_job(rid)
        self.phase = "exec"

    def _junction_job(self, rid: int) -> None:
        """docs/junctions.md: a chunk that ended at the request's junction snapshots the state
        into a fresh block and a store job of this step puts it (with the attention KV from the
        lcm floor) after the forward; the job's pin is the block's only holder."""
        c, r = self.cfg, self.reqs[rid]
        j = c.junction(rid)
        if not j or r.status != "running" or r.computed != j or self.scheduled[rid] == j:
            return
        if not r.mamba or r.mamba[-1] == NULL or not self.fq:
            return
        slot = self.get_new_blocks(1)[0]
        self.snapshots.append((rid, r.mamba[-1], slot, j))
        p = c.seq(rid)
        lo, hi = tail_put_range(j, c.lcm, c.bs_fa, 0)
        puts: list[Put] = [(FA, p[: min((i + 1) * c.bs_fa, j)], r.fa[i])
                           for i in range(lo, min(hi, len(r.fa))) if r.fa[i] != NULL]
        puts.append((MAMBA, p[:j], slot))
        ids = self.job_blocks(r, puts, j)
        self.pin(ids)
        self.free_blocks([slot])
        self.jobs[self.next_job] = StoreJob(rid, r.generation, tuple(ids), tuple(puts), self.step)
        self.next_job += 1

    # ----------------------------------------------------------------- turn-end extension
    def _snapshot(self, rid: int) -> None:
        """docs/reuse.md rule 1: a step ending on a hash boundary past ck(P) copies the running
        state into the request's snapshot block (taken from the pool the first time, if one is
        free), after the step's forward."""
        c, r = self.cfg, self.reqs[rid]
        e = r.computed
        if r.status != "running" or e == self.scheduled[rid] or not r.mamba:
            return
        if not snapshot_due(e, len(r.prompt), c.h, c.use_eagle) or r.mamba[-1] == NULL:
            return
        if r.slot is None:
            if not self.fq:
                return  # no free block: no checkpoint (a later miss, never wrong bytes)
            r.slot = (self.get_new_blocks(1)[0], e)
        slot = r.slot[0]
        r.slot = (slot, e)
        self.snapshots.append((rid, r.mamba[-1], slot, e))
        if e == round_down(len(c.seq(rid)), c.h):  # rule 3b: the last boundary, flushed now
            self._flush(rid, self.step)

    def due_snapshots(self) -> list[tuple[int, int, int, int]]:
        """The snapshot copies this execution runs: the step's own (``wait_for_save`` follows
        the forward)."""
        out, self.snapshots = self.snapshots, []
        return out

    def release_slot(self, r: Req) -> None:
        """The connector drops its reference on a request's snapshot block."""
        if r.slot is not None:
            self.free_blocks([r.slot[0]])
            r.slot = None

    def turn_end_puts(self, rid: int, slot: int, b: int) -> list[Put]:
        """docs/reuse.md rule 3: the slot keyed at its boundary, plus the attention blocks up to
        it (the spec does not model normal saves, so every FA block below ``b``)."""
        c, r = self.cfg, self.reqs[rid]
        p = c.seq(rid)
        puts: list[Put] = [(FA, p[: min((i + 1) * c.bs_fa, b)], r.fa[i])
                           for i in range(min(cdiv(b, c.bs_fa), len(r.fa))) if r.fa[i] != NULL]
        return puts + [(MAMBA, p[:b], slot)]

    def _flush(self, rid: int, fence: int | None = None) -> None:
        """docs/reuse.md rule 3 at finish, before the tables are freed (or rule 3b, in the step
        whose snapshot is the request's last boundary: ``fence`` is that step, so the job runs
        after its copy): pin the job's blocks, then drop the connector's own reference on the
        slot."""
        r = self.reqs[rid]
        if r.slot is None:
            return
        slot, b = r.slot
        if b > r.computed:
            self.release_slot(r)
            return
        puts = self.turn_end_puts(rid, slot, b)
        ids = self.job_blocks(r, puts, b)
        self.pin(ids)
        self.release_slot(r)
        fence = self.executed if fence is None else fence
        self.jobs[self.next_job] = StoreJob(rid, r.generation, tuple(ids), tuple(puts), fence)
        self.next_job += 1

    def _handoff(self, rid: int, g: int, b: int, n: int, fence: int) -> None:
        """``_handle_boundary_state_offloads`` + ``_reference_save_blocks``: accept a hand-off of
        a live producer within its prefill (past it too with ``decode_checkpoints``: a decode
        step's aligned state), add the attention tail puts, pin every distinct block once
        (``pool.touch``)."""
        c, r = self.cfg, self.reqs[rid]
        if r.status != "running" or n > len(r.prompt) and not c.decode_checkpoints:
            return
        if b == NULL:
            return
        p = c.seq(rid)
        puts = [(g, p[:n], b)]
        if n % c.bs_mamba:
            lo, hi = tail_put_range(n, c.lcm, c.bs_fa, 0)
            puts += [(FA, p[: min((i + 1) * c.bs_fa, n)], r.fa[i])
                     for i in range(lo, min(hi, len(r.fa))) if r.fa[i] != NULL]
        ids = self.job_blocks(r, puts, n)
        self.pin(ids)
        self.jobs[self.next_job] = StoreJob(rid, r.generation, tuple(ids), tuple(puts), fence)
        self.next_job += 1

    def do_execute(self) -> None:
        """The worker runs the step: the drained copies (after zeroing, before the forward), then
        the forward pass of every scheduled chunk. Reads are checked against the ghost."""
        c = self.cfg
        for _, src, dst in self.copies:
            self.content[dst] = self.content[src]
        writes: list[tuple[int, Key]] = []
        for rid, s in sorted(self.scheduled.items()):
            r = self.reqs[rid]
            e = r.computed
            if r.status != "running" or e == s or not r.mamba:
                continue
            p = c.seq(rid)
            if s:  # Mamba reads the state at s: the running block or the previous snapshot
                prev = r.mamba[-2] if s % c.bs_mamba == 0 else r.mamba[-1]
                if self.content[prev] != (MAMBA, p[:s]):
                    self.bad(f"mamba read r{rid}@{s} block {prev}")
            for i in range(s // c.bs_fa, cdiv(e, c.bs_fa)):
                writes.append((r.fa[i], (FA, p[: min(e, (i + 1) * c.bs_fa)])))
            writes.append((r.mamba[-1], (MAMBA, p[:e])))
        for b, v in writes:
            self.content[b] = v
        for rid, src, slot, n in self.due_snapshots():  # wait_for_save, after the forward
            if self.content[src] != (MAMBA, c.seq(rid)[:n]):
                self.bad(f"snapshot read r{rid}@{n} block {src}")
            self.content[slot] = self.content[src]
        for rid, s in sorted(self.scheduled.items()):  # attention reads the whole prefix
            r = self.reqs[rid]
            for i in range(cdiv(s, c.bs_fa) if r.status == "running" else 0):
                if not self.fa_valid(r.fa[i], c.seq(rid)[: min(s, (i + 1) * c.bs_fa)]):
                    self.bad(f"attention read r{rid} block {r.fa[i]}")
        self.copies, self.fresh = [], set()
        self.scheduled.clear()
        self.executed, self.phase = self.step, "idle"

    def fa_valid(self, b: int, p: tuple[int, ...]) -> bool:
        v = self.content[b]
        return v is not None and v[0] == FA and v[1][: len(p)] == p and len(v[1]) >= len(p)

    def key_valid(self, key: Key, v: Key | None) -> bool:
        """Whether bytes ``v`` serve ``key``: Mamba state exactly, attention KV as a prefix."""
        if v is None or v[0] != key[0]:
            return False
        return v == key if key[0] == MAMBA else v[1][: len(key[1])] == key[1]

    def do_finish(self, rid: int) -> None:
        """``Scheduler._free_request``: ``finalize_partial_tail_offloads`` (a hand-off of the
        table source if computation stopped exactly at the marker), pin it while the request still
        owns it (``register_finished_partial_tail``), then free the tables (reversed)."""
        r = self.reqs[rid]
        if r.marker is not None:
            src, n = r.marker
            r.marker = None
            if r.computed == n:
                self._handoff(rid, MAMBA, src, n, self.executed)
        self._flush(rid)
        ids = self.pop_tables(r)
        if self.cfg.defer_block_free:
            self.retained.append((self.step, tuple(ids), "req"))
        else:
            self.free_blocks(ids)
        r.status = "finished"

    def do_release(self, idx: int) -> None:
        """Release a deferred retention / request free once its fence step has executed."""
        _, ids, _ = self.retained.pop(idx)
        self.free_blocks(ids)

    def do_evict(self, b: int) -> None:
        """``BlockPool.evict_blocks``: strip every key of b (even if b is held)."""
        for k in self.block_keys(b):
            del self.keys[k]

    def do_reset(self) -> None:
        """``reset_prefix_cache``: only when every non-null block is free."""
        all_free = len(self.fq) == self.cfg.num_blocks - 1
        if all_free:
            self.keys.clear()
        self.last_reset = (all_free, all_free)

    def do_run_job(self, jid: int, rank: int, outcome: str) -> None:
        """One worker rank runs a store job after the step's event: pressure gate, then the
        boundary puts (``ok``: all stored; ``full``: -200, pressure; ``error``: nothing)."""
        j = self.jobs[jid]
        self.jobs[jid] = j.but(ran=j.ran | {rank})
        live = self.reqs[j.rid].generation == j.generation
        if not live or (self.pressure and j.rid in self.skip):
            return
        new = [(g, p, b) for g, p, b in j.puts if (rank, g, p) not in self.store]
        if outcome == "ok" and new:
            for g, p, b in new:
                self.store[(rank, g, p)] = self.content[b]
            self.pressure, self.skip = False, frozenset()
        elif outcome == "full" and new:
            self.mark_pressure(j.rid, rank, new)

    def do_report(self, jid: int, rank: int) -> None:
        """``update_connector_output``: a rank reports; the pins go when every rank has."""
        j = self.jobs[jid]
        j = j.but(reported=j.reported | {rank})
        done = len(j.reported) == self.cfg.workers
        if self.unpins(j) and not j.released:
            self.free_blocks(list(reversed(j.ids)))
            j = j.but(released=True)
        if done:
            del self.jobs[jid]
        else:
            self.jobs[jid] = j


def initial(cfg: Config) -> State:
    """The empty engine: every non-null block free, no keys, no requests admitted."""
    return State(cfg)
