"""The records of the spec: the instance a model runs on and the values a state holds.

:class:`Config` is one model instance (geometry, pool, workload); :class:`Req`, :class:`StoreJob`
and :class:`Hit` are a request, a connector store job and the last lookup. The transition
rules that change them are in :mod:`spec.model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .arithmetic import checkpoint_position, hit_alignment, lcm_all, partial_hash_hits_enabled

NULL = 0
FA, MAMBA = 0, 1
Key = tuple[int, tuple[int, ...]]  # (group, prefix tokens): the comparable form of a block hash
Put = tuple[int, tuple[int, ...], int]  # a boundary put: (group, prefix tokens, block)


@dataclass(frozen=True)
class Config:
    """Geometry, pool and workload of one model instance (small on purpose: it is enumerated)."""

    h: int = 2
    bs_fa: int = 2
    bs_mamba: int = 4
    num_blocks: int = 8
    prompts: tuple[tuple[int, ...], ...] = ((1, 1, 2, 2), (1, 1, 2, 2, 3))
    workers: int = 2
    defer_block_free: bool = False
    use_eagle: bool = False
    outcomes: tuple[str, ...] = ("ok", "full", "error")
    priority_preempt: bool = False
    # The reuse extension (docs/reuse.md), not vLLM 0.33: tokens each request decodes after its
    # prompt (one per step), and turn-end checkpoints (snapshot blocks flushed at finish).
    responses: tuple[tuple[int, ...], ...] = ()
    turn_end: bool = False
    # Junction checkpoints: the shared-prefix junction the connector set for each request
    # (``Request.shared_prefix_boundary``; 0: none). Its chunk stops there exactly, and a
    # junction job stores the state (a snapshot block the job alone pins) with the attention KV.
    junctions: tuple[int, ...] = ()
    # vLLM 0.34 with ``save_decode_cache`` (docs/releases.md): the Mamba states of decode-time
    # block boundaries are stored too (``_handle_boundary_state_offloads``; 0.33 drops them).
    decode_checkpoints: bool = False

    def junction(self, rid: int) -> int:
        return self.junctions[rid] if rid < len(self.junctions) else 0

    def seq(self, rid: int) -> tuple[int, ...]:
        """Request ``rid``'s whole token sequence: its prompt, then its response."""
        resp = self.responses[rid] if rid < len(self.responses) else ()
        return self.prompts[rid] + resp

    @property
    def lcm(self) -> int:
        return lcm_all([self.bs_fa, self.bs_mamba])

    @property
    def partial_hits(self) -> bool:
        """``partial_hash_hits_enabled`` on the one FA + Mamba-align pair the model has."""
        return partial_hash_hits_enabled([self.bs_mamba], self.h, hybrid=True)

    @property
    def A(self) -> int:  # noqa: N802 - the alignment unit's name in docs/spec.md
        return hit_alignment(self.h, self.lcm, self.partial_hits)


@lru_cache(maxsize=4096)
def ck_int(p: int, h: int, eagle: bool) -> int:
    """:func:`spec.arithmetic.checkpoint_position` on ints, memoised for state-space search."""
    return checkpoint_position(p, h, eagle)


@dataclass
class Req:
    """One request: prompt, progress, block tables and Mamba producer marker."""

    prompt: tuple[int, ...]
    status: str = "waiting"  # waiting | running | finished
    computed: int = 0  # num_computed_tokens (advanced at schedule time, as vLLM does)
    fa: list[int] = field(default_factory=list)
    mamba: list[int] = field(default_factory=list)
    marker: tuple[int, int] | None = None  # _producer_partial_tail_reqs: (source block, boundary)
    stops: tuple[int, ...] = ()  # chunk ends since the last (re)start
    generation: int = 0  # bumped by preemption: older store jobs become "not live"
    slot: tuple[int, int] | None = None  # turn-end snapshot: (connector-held block, boundary)

    def clone(self) -> Req:
        r = Req.__new__(Req)
        r.__dict__.update(self.__dict__)
        r.fa, r.mamba = list(self.fa), list(self.mamba)
        return r


@dataclass
class StoreJob:
    """A connector store job: the distinct blocks it pins and the boundary puts it performs."""

    rid: int
    generation: int
    ids: tuple[int, ...]
    puts: tuple[Put, ...]
    fence: int  # the step whose execution the job synchronizes on (current_event.synchronize)
    ran: frozenset[int] = frozenset()
    reported: frozenset[int] = frozenset()
    released: bool = False

    def but(self, **changes: object) -> StoreJob:
        """A copy with ``changes`` (``dataclasses.replace`` without its per-call introspection:
        the bounded search copies a job on every worker step)."""
        j = StoreJob.__new__(StoreJob)
        j.__dict__.update(self.__dict__)
        j.__dict__.update(changes)
        return j


@dataclass
class Hit:
    """The last lookup: what ``find_longest_cache_hit`` returned and the keys it saw."""

    rid: int
    num_tokens: int
    hit: int
    fa: tuple[int, ...]
    mamba: tuple[int, ...]
    keys: frozenset[Key]
