"""The ops of one engine step, in the order vLLM 0.33's ``Scheduler.schedule`` issues them.

Every tool that writes traces (the case authors, the generators, the spec's exporter) builds
its steps here, so "one engine step" is written once. ``docs/trace-format.md`` ("The ops of
one engine step") documents the recipe for people writing traces by hand.

A ``Steps`` writes ops through ``emit``, a function that takes an op and returns its
observation, or None when the ops are only being written down (authoring without running).
With observations the writer issues only what the scheduler would: no allocation after an
empty chunk, no commit after a failed allocation, no release without a drained retention.
Without them it assumes the chunk is non-empty and the allocation succeeds, and writes every op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tailproof.conformance.format.ops import REQUIRED, all_op_specs

Op = dict[str, Any]
Observation = dict[str, Any]
Emit = Callable[[Op], Observation | None]

_SPECS = all_op_specs()


def op(name: str, **fields: Any) -> Op:
    """A trace op carrying the fields that differ from the op's defaults (``ops.py``), in the
    order given: the compact form the corpus is written in."""
    spec = _SPECS[name]
    out: Op = {"op": name}
    for key, value in fields.items():
        if key not in spec:
            raise ValueError(f"op {name!r} has no field {key!r}")
        if spec[key].default is REQUIRED or value != spec[key].default:
            out[key] = value
    return out


def _planned(obs: Observation | None) -> bool:
    return obs is None or bool(obs.get("chunk"))


def _allocated(obs: Observation | None) -> bool:
    return obs is None or bool(obs.get("ok"))


class Steps:
    """Writes engine steps as trace ops through ``emit``; ``connector`` adds the connector's
    admission lookup (``sched_lookup``) and step (``conn_step``)."""

    def __init__(self, emit: Emit, connector: bool = False) -> None:
        self.emit = emit
        self.connector = connector
        self.deferred = False  # the last sched_lookup answered None (ask again next step)

    def begin(self) -> None:
        """``KVCacheManager.new_step_starts``: a new scheduling pass."""
        self.emit(op("new_step"))

    def schedule(self, rid: str, n: int | str = "plan", use_hit: bool = False,
                 external: int = 0, budget: int | None = None,
                 delay_cache: bool = False) -> bool:
        """A request's chunk: sized by ``plan_chunk`` (the scheduler's token budget, then
        ``Scheduler._mamba_block_aligned_split``) unless ``n`` is given, then ``allocate``
        (``KVCacheManager.allocate_slots``), with the pending hit when ``use_hit``. Returns
        whether it was allocated (and so needs a commit)."""
        if n == "plan":
            plan = self.emit(op("plan_chunk", rid=rid, use_hit=use_hit, external=external,
                                budget=budget))
            if not _planned(plan):
                return False
        return _allocated(self.emit(op("allocate", rid=rid, n=n, use_hit=use_hit,
                                       external=external, delay_cache=delay_cache)))

    def run(self, rid: str, n: int | str = "plan", budget: int | None = None) -> bool:
        """A running request's next chunk (``Scheduler.schedule``'s running loop)."""
        return self.schedule(rid, n, budget=budget)

    def lookup(self, rid: str, connector_lookup: bool | None = None) -> tuple[int, int | None]:
        """A waiting request's prefix lookups: the local cache (``get_computed_blocks``) and,
        with a connector, ``sched_lookup`` (``get_num_new_matched_tokens``). Returns the
        local hit and the external tokens to load (None without a connector lookup; 0
        without observations)."""
        hit = (self.emit(op("lookup", rid=rid)) or {}).get("hit", 0)
        if not (self.connector if connector_lookup is None else connector_lookup):
            return hit, None
        res = self.emit(op("sched_lookup", rid=rid)) or {}
        self.deferred = "ext" in res and res["ext"] is None
        return hit, res.get("external") or 0

    def admit(self, rid: str, n: int | str = "plan", external: int = 0,
              budget: int | None = None, connector_lookup: bool | None = None,
              delay_cache: bool = False) -> bool:
        """A waiting request (``Scheduler.schedule``'s waiting loop): ``lookup`` then its first
        chunk with the hit; a connector lookup's external tokens replace ``external``."""
        self.deferred = False
        _, ext = self.lookup(rid, connector_lookup)
        if self.deferred:  # get_num_new_matched_tokens answered None: skipped this step
            return False
        return self.schedule(rid, n, True, external if ext is None else ext, budget, delay_cache)

    def drain(self, release: bool | None = None) -> None:
        """The step's hand-offs (``take_boundary_state_offloads``) and CoW copies
        (``take_kv_cache_block_copies``); the copies' retention is released at once
        (``defer_block_free`` off) when ``release`` is None and one was drained, always when
        True, never when False."""
        self.emit(op("drain_offloads"))
        copies = self.emit(op("drain_copies"))
        if release or (release is None and (copies is None or copies.get("handle") is not None)):
            self.emit(op("release_retained"))

    def commit(self, rid: str) -> None:
        """``Scheduler._update_after_schedule`` for one request: the allocated tokens count."""
        self.emit(op("commit", rid=rid))

    def end(self, commits: Iterable[str] = (), release: bool | None = None,
            finished: Iterable[str] = (), preempted: Iterable[str] = (),
            offer: list[list[Any]] | None = None) -> Observation | None:
        """The end of a step: drains, the connector step (with the requests finished or
        preempted since the last one, and ``offer``: hand-offs the core never produced),
        then the commits. Returns the ``conn_step`` observation (None without a connector)."""
        self.drain(release)
        obs = None
        if self.connector:
            extra = {"offer": offer} if offer else {}
            obs = self.emit(op("conn_step", finished=list(finished), preempted=list(preempted),
                               **extra))
        for rid in commits:
            self.commit(rid)
        return obs

    def step(self, run: Iterable[str] = (), admit: Iterable[str] = (),
             n: Mapping[str, int] | None = None, external: Mapping[str, int] | None = None,
             budget: int | None = None, connector_lookup: bool | None = None,
             release: bool | None = None, finished: Iterable[str] = (),
             preempted: Iterable[str] = ()) -> Observation | None:
        """One whole engine step: running requests first, then admissions, then ``end``.
        ``n`` fixes a request's chunk (no ``plan_chunk``); ``external`` gives an admission's
        externally computed tokens when there is no connector lookup."""
        n, external = n or {}, external or {}
        self.begin()
        ok = [rid for rid in run if self.run(rid, n.get(rid, "plan"), budget)]
        ok += [rid for rid in admit
               if self.admit(rid, n.get(rid, "plan"), external.get(rid, 0), budget,
                             connector_lookup)]
        return self.end(ok, release, finished, preempted)

    def prefill(self, rid: str, chunks: int) -> None:
        """``chunks`` planned steps of one request, the first one its admission."""
        self.step(admit=(rid,))
        for _ in range(chunks - 1):
            self.step(run=(rid,))

    def finish(self, rid: str) -> None:
        """A finished request's block side (``Scheduler._free_request``): the finish-time tail
        (``conn_finish`` with a connector, ``finalize_tail`` without), then ``free``. With a
        connector, list ``rid`` in the next ``end``'s ``finished``."""
        self.emit(op("conn_finish" if self.connector else "finalize_tail", rid=rid))
        self.emit(op("free", rid=rid))
