"""Seeded mutants of the transition rules: each must be killed (yield a counterexample).

A mutant is a subclass of :class:`spec.model.State` that overrides one small rule with a bug
(and, where the bug needs it, an instance that exposes it). The bounded search runs on the
mutated model; the first invariant violation is the counterexample, reported with its shortest
action sequence. ``ck_off_by_one`` and ``hit_unaligned`` are also killed by the z3 lemmas run on
the mutated arithmetic (see ``lemmas.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..arithmetic import cdiv, round_down
from ..model import Config, Key, Req, State, StoreJob, ck_int
from .bmc import bmc

Put = tuple[int, tuple[int, ...], int]


@dataclass(frozen=True)
class Mutant:
    """One seeded bug: what it does, the model that has it, the instance that exposes it."""

    what: str
    model: type[State]
    overrides: dict[str, Any] = field(default_factory=dict)


#: name -> mutant, in the order ``tailproof prove`` reports them
MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, what: str, **overrides: Any) -> Callable[[type[State]], type[State]]:
    """Register the decorated ``State`` subclass as the mutant ``name``."""

    def register(model: type[State]) -> type[State]:
        MUTANTS[name] = Mutant(what, model, overrides)
        return model

    return register


@mutant("drop_pin", "the connector records a store job but does not touch its blocks")
class DropPin(State):
    def pin(self, ids: list[int]) -> None:
        pass


@mutant("release_early", "a CoW retention is released when the copy is queued, before it ran")
class ReleaseEarly(State):
    def queue_copy(self, g: int, src: int, dst: int) -> None:
        super().queue_copy(g, src, dst)
        self.free_blocks([src, dst])

    def release_copies(self, ids: tuple[int, ...]) -> None:
        pass  # released already


@mutant("early_unpin", "a store job unpins at the first rank's report, not the last")
class EarlyUnpin(State):
    def unpins(self, j: StoreJob) -> bool:
        return True


@mutant("pin_null", "the job's blocks are resolved positionally from the Mamba table, nulls kept",
        h=1, bs_fa=1, bs_mamba=2, prompts=((1, 1, 2, 2), (1, 1, 2, 2, 3)))
class PinNull(State):
    def job_blocks(self, r: Req, puts: list[Put], n: int) -> list[int]:
        ids = super().job_blocks(r, puts, n)
        return list(dict.fromkeys(ids + r.mamba[: cdiv(n, self.cfg.bs_mamba)]))


@mutant("handoff_after_free", "preemption keeps the request's undrained hand-offs",
        priority_preempt=True)
class HandoffAfterFree(State):
    def drop_handoffs(self, rid: int) -> None:
        pass


@mutant("ck_off_by_one", "ck(P) uses floor(P/h)*h (forgets the recomputed last token)")
class CkOffByOne(State):
    def ck(self, p: int) -> int:
        return ck_int(p + 1, self.cfg.h, self.cfg.use_eagle)


@mutant("hit_unaligned", "the joint hit is capped by num_tokens-1 instead of its A-floor")
class HitUnaligned(State):
    def hit_limit(self, num_tokens: int) -> int:
        return round_down(num_tokens, self.cfg.h)


@mutant("no_clipping", "FA keeps its longer hit when Mamba lacks the tail (no cdiv truncation)")
class NoClipping(State):
    def clip_fa(self, blocks: list[int], hit: int) -> list[int]:
        return blocks


@mutant("put_fail_key", "a failed (-200) put still leaves its key in the store")
class PutFailKey(State):
    def mark_pressure(self, rid: int, rank: int, keys: list[Put]) -> None:
        super().mark_pressure(rid, rank, keys)
        for g, p, _ in keys:
            self.store[(rank, g, p)] = None


@mutant("double_free", "preemption frees the tables but does not pop them")
class DoubleFree(State):
    def pop_tables(self, r: Req) -> list[int]:
        return list(reversed(r.fa)) + list(reversed(r.mamba))


@mutant("no_same_step_defer", "a Mamba key registered/moved this step is hit in the same step")
class NoSameStepDefer(State):
    def deferred(self, key: Key) -> bool:
        return False


@mutant("no_key_move", "the running CoW leaves the tail key on the overwritten source")
class NoKeyMove(State):
    def move_block_hashes(self, src: int, dst: int) -> None:
        pass


# --- the turn-end extension (docs/reuse.md): one request, a prompt of 4 (ck = 2), a response of 2
_TURN_END = {"prompts": ((1, 1, 2, 2),), "responses": ((3, 3),), "turn_end": True,
             "workers": 1}


@mutant("te_wrong_boundary", "the turn-end flush keys the snapshot one hash unit too far",
        **_TURN_END)
class TurnEndWrongBoundary(State):
    def turn_end_puts(self, rid: int, slot: int, b: int) -> list[Put]:
        puts = super().turn_end_puts(rid, slot, b)
        g, _, blk = puts[-1]
        return [*puts[:-1], (g, self.cfg.seq(rid)[: b + self.cfg.h], blk)]


@mutant("te_snapshot_late", "the snapshot copy runs one step late (after the next forward)",
        **_TURN_END)
class TurnEndSnapshotLate(State):
    def due_snapshots(self) -> list[tuple[int, int, int, int]]:
        late = getattr(self, "_late", [])
        self._late, self.snapshots = self.snapshots, []
        return late

    def extra_blocks(self) -> tuple[int, ...]:
        return tuple(b for _, src, slot, _ in getattr(self, "_late", []) for b in (src, slot))

    def extra_fingerprint(self, lab: list[int]) -> tuple:
        return tuple((rid, lab[src], lab[slot], n)
                     for rid, src, slot, n in getattr(self, "_late", []))


@mutant("te_pin_released_early", "the flush job does not pin the snapshot block it puts",
        **_TURN_END)
class TurnEndPinReleasedEarly(State):
    def job_blocks(self, r: Req, puts: list[Put], n: int) -> list[int]:
        ids = super().job_blocks(r, puts, n)
        return ids[:-1] if r.slot is not None and ids and ids[-1] == r.slot[0] else ids


# --- vLLM 0.34's decode checkpoints: a one-token prompt whose first decode step fills a block
_DECODE_CHECKPOINTS = {"h": 1, "bs_fa": 1, "bs_mamba": 2, "prompts": ((1,),),
                       "responses": ((2, 3),), "decode_checkpoints": True, "workers": 1}


@mutant("dc_keyed_by_prompt", "a decode checkpoint is keyed by the prompt's prefix alone",
        **_DECODE_CHECKPOINTS)
class DecodeCheckpointKeyedByPrompt(State):
    def job_blocks(self, r: Req, puts: list[Put], n: int) -> list[int]:
        p = tuple(r.prompt)
        puts[:] = [(g, pre[: len(p)] if len(pre) > len(p) else pre, b) for g, pre, b in puts]
        return super().job_blocks(r, puts, n)


@dataclass(frozen=True)
class MutantConfig(Config):
    """The instance a mutant was found on: its config plus the mutant's name. The model's own
    ``initial`` builds the unmutated system from it (what an exported trace shows)."""

    mutant: str | None = None


@dataclass
class MutantResult:
    """Whether a mutant was killed, by which invariant, and the counterexample."""

    name: str
    killed: bool
    invariant: str | None
    message: str | None
    trace: list[tuple] | None
    seconds: float
    config: MutantConfig
    model: type[State]


def run_mutant(name: str, base: Config, depth: int, deadline_s: float = 30.0,
               symmetry: bool = True) -> MutantResult:
    """Search the mutated model up to ``depth`` for an invariant violation."""
    t0 = time.monotonic()
    m = MUTANTS[name]
    cfg = MutantConfig(**{**vars(base), **m.overrides, "mutant": name})
    r = bmc(cfg, depth, deadline_s=deadline_s, model=m.model, symmetry=symmetry)
    v = r.violation
    return MutantResult(name, not r.ok, v[0] if v else None, v[1] if v else None, r.trace,
                        time.monotonic() - t0, cfg, m.model)
