"""EXTENSION, not vLLM 0.33: the reuse extension as the scheduler role's collaborator.

``scheduler_side.SchedulerSide`` is vLLM 0.33's Mooncake scheduler. It holds one extension
object and calls it at the named points below (each call site marked ``EXTENSION``, as in
``reference/connector/scheduler.py``); the two share no ``self``: the scheduler side passes what
a point needs (the request, its tracker, the step's output) and gives the extension its
``seal``, through which the extension's own store jobs are sealed and pinned.

What runs with the extension off is :class:`NoExtension`: every point does nothing, answers
"no", or has nothing to report. With ``Settings.reuse_extension`` the scheduler side holds a
:class:`ReuseExtension` instead, which hands each point to its parts: the turn-end checkpoints,
decode-boundary saves and lookup wait (``turn_end.py``, docs/reuse.md) and the junction
checkpoints (``junctions.py``, docs/junctions.md).

The points, in the order a step meets them:

==========================  ==================================================================
``lookup_waits``            connector lookup: wait for an in-flight flush (rule 7)
``after_lookup``            connector lookup answered: the junction stop (junction rule 1)
``forget`` / ``preempted``  ``build_connector_meta``: finished and preempted requests (rule 4)
``begin_step``              the step's ends; a step the extension refuses turns it off
``decode_saves``            hand-offs: decode boundaries are stored (rule 5)
``decode_boundary_puts``    ``seal``: the attention puts of a draft's decode boundaries
``job_sealed``              ``seal``: a pinned job's Mamba keys are waited on (rule 7)
``end_step``                after the step's jobs: the turn-end jobs sealed at finish, then
                            snapshots, rule 3b flushes, junction jobs
``job_released``            ``update_connector_output``: a job's keys are no longer waited on
``finish_turn``             ``request_finished_all_groups``: the turn-end flush (rule 3)
==========================  ==================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.junctions import JunctionCheckpoints
from tailproof.impl.meta import BoundaryPut, SaveDraft, StoreJob, TailproofMeta
from tailproof.impl.metrics import SchedulerMetrics
from tailproof.impl.turn_end import InflightKeys, Seal, TurnEndCheckpoints, step_ends

logger = logging.getLogger(__name__)


class NoExtension:
    """The reuse extension off (vLLM 0.33's rules only): every point does nothing."""

    decode_saves = False  # rule 5: decode-time hand-offs are stored, with attention puts
    disabled = False  # set once the extension turned itself off (a step it refuses)
    #: whether the step and job points (``begin_step``, ``job_sealed``, ``end_step``,
    #: ``job_released``) do anything: the core skips them when not, so that with the extension
    #: off a save never leaves the core (docs/architecture.md, "One save, walked")
    steps = False

    def bind_pool(self, pool: Any) -> None:
        """vLLM's ``BlockPool``, once the scheduler has one."""

    def lookup_waits(self, request: Any, hit: int, num_computed: int) -> bool:
        """Rule 7: whether the lookup must be asked again next step."""
        return False

    def after_lookup(self, request: Any, hit: int) -> None:
        """Junction rule 1: the lookup answered a hit of ``hit`` tokens."""

    def forget(self, rid: str) -> None:
        """A finished (or aborted) request."""

    def preempted(self, rid: str, readmitted: bool) -> None:
        """A preempted request (``readmitted``: admitted again in this same step)."""

    def begin_step(self, so: Any, requests: Mapping[str, Any]) -> None:
        """A step's ``SchedulerOutput``, before its jobs are drafted."""

    def step_end(self, rid: str, default: int) -> int:
        """Where this step's forward leaves ``rid`` (``default`` when not known)."""
        return default

    def decode_boundary_puts(self, d: SaveDraft, t: Any) -> list[BoundaryPut]:
        """Rule 5: the attention puts of ``d``'s decode boundaries (``t``: its tracker)."""
        return []

    def job_sealed(self, job: StoreJob, pinned: bool) -> None:
        """A job was sealed (``pinned``: it holds pins until every worker reported it)."""

    def end_step(self, state: Any, meta: TailproofMeta, requests: Mapping[str, Any],
                 trackers: Mapping[str, Any]) -> None:
        """After the step's own jobs: the extension's jobs sealed at finish (rule 3), then
        this step's copies and jobs (rules 1 and 3b, junction rule 2) join ``meta``."""

    def job_released(self, job: int) -> None:
        """Every worker reported ``job``; its pins are released."""

    def pending_jobs(self) -> int:
        """Jobs sealed but not yet emitted (a prefix-cache reset waits for them)."""
        return 0

    def finish_turn(self, request: Any, block_ids: tuple[list[int], ...],
                    t: Any) -> StoreJob | None:
        """Rule 3: the request finished (``t``: its tracker); its turn-end job, if any."""
        return None

    def junction_hook_ran(self, vllm_keys_junctions: bool) -> None:
        """vLLM's scheduler hook made junction stops exact (docs/junctions.md, "The hook")."""

    def snapshot_slots(self) -> dict[str, tuple[list[int], int]]:
        """rid -> (snapshot blocks, the boundary they hold) (the trace's ``conn_state``)."""
        return {}

    def junction_stops(self) -> dict[str, int]:
        """rid -> the junction its chunk stops at (the trace's ``conn_state``)."""
        return {}


class ReuseExtension(NoExtension):
    """The reuse extension on (``Settings.reuse_extension``): its parts, and the step state
    they share (the step's ends; whether a step turned the extension off)."""

    steps = True

    def __init__(self, settings: Settings, geo: StoreGeometry, metrics: SchedulerMetrics,
                 seal: Seal) -> None:
        self.settings = settings
        self.turn_end = TurnEndCheckpoints(settings, geo, metrics, seal)
        # A consumer stores nothing, so it never stops a chunk at a junction either.
        self.junctions = (JunctionCheckpoints(settings, geo, metrics, self.turn_end)
                          if settings.junction_checkpoints and not settings.is_consumer
                          else None)
        self.inflight = InflightKeys(geo) if settings.checkpoint_lookup_wait else None
        self.disabled = False
        self.decode_saves = bool(settings.decode_boundary_saves)
        self._active = False  # this step runs the extension (a producer, not disabled)
        self._ends: dict[str, int] = {}  # rid -> real tokens computed after this step
        if settings.is_consumer:
            logger.info("TailproofConnector: the reuse extension is on but the role is a "
                        "consumer, which stores nothing: no snapshots, turn-end, decode-"
                        "boundary or junction checkpoints (docs/reuse.md)")

    def bind_pool(self, pool: Any) -> None:
        self.turn_end.pool = pool

    def lookup_waits(self, request: Any, hit: int, num_computed: int) -> bool:
        inflight = self.inflight
        return bool(inflight is not None and inflight.keys
                    and inflight.waits(request, max(hit, num_computed)))

    def after_lookup(self, request: Any, hit: int) -> None:
        if self.junctions is not None and not self.disabled:
            self.junctions.at_lookup(request, hit)

    def forget(self, rid: str) -> None:
        self.turn_end.release(rid)  # finish_turn normally did; a no-op then
        if self.junctions is not None:
            self.junctions.forget(rid, finished=True)

    def preempted(self, rid: str, readmitted: bool) -> None:
        self.turn_end.release(rid)  # rule 4: its state is recomputed
        if self.junctions is not None and not readmitted:
            self.junctions.forget(rid, finished=False)  # re-admission sets it again

    def begin_step(self, so: Any, requests: Mapping[str, Any]) -> None:
        self._active = not self.settings.is_consumer and not self.disabled
        if self._active:
            self._check_step_supported(so)
            self._active = not self.disabled
        self._ends = step_ends(so, requests) if self._active else {}

    def _check_step_supported(self, so: Any) -> None:
        """Disable the extension (one logged error) when a step shows speculative tokens: the
        config check refuses speculative decoding, this catches what it could not see; a
        snapshot of a step that does not end on a known boundary would store wrong bytes."""
        if not getattr(so, "scheduled_spec_decode_tokens", None):
            return
        logger.error("TailproofConnector: a step scheduled speculative tokens; turn-end "
                     "checkpoints and decode boundary saves are disabled (docs/reuse.md, "
                     "Limits)")
        self.disabled = True
        self.decode_saves = False
        for rid in list(self.turn_end.snapshot_slots):
            self.turn_end.release(rid)

    def step_end(self, rid: str, default: int) -> int:
        return self._ends.get(rid, default)

    def decode_boundary_puts(self, d: SaveDraft, t: Any) -> list[BoundaryPut]:
        return self.turn_end.decode_boundary_puts(d, t)

    def job_sealed(self, job: StoreJob, pinned: bool) -> None:
        if self.inflight is not None and pinned:  # nothing pinned: never a key to wait on
            self.inflight.register(job)

    def end_step(self, state: Any, meta: TailproofMeta, requests: Mapping[str, Any],
                 trackers: Mapping[str, Any]) -> None:
        done = self.turn_end.finished
        if done:  # after the step's jobs and the finished partial tails
            meta.stores.extend(done.values())
            done.clear()
        if self._active and state is not None:
            if self.settings.turn_end_checkpoints:
                self.turn_end.take_snapshots(self._ends, state, meta, requests, trackers)
            if self.junctions is not None and self.junctions.targets:
                self.junctions.jobs(self._ends, state, meta, requests)
        self._ends = {}

    def job_released(self, job: int) -> None:
        if self.inflight is not None and self.inflight.job_keys:
            self.inflight.release(job)

    def pending_jobs(self) -> int:
        return len(self.turn_end.finished)

    def finish_turn(self, request: Any, block_ids: tuple[list[int], ...],
                    t: Any) -> StoreJob | None:
        return self.turn_end.finish_turn(request, block_ids, t)

    def junction_hook_ran(self, vllm_keys_junctions: bool) -> None:
        if self.junctions is not None:
            self.junctions.exact_stops = True
            self.junctions.vllm_keys_junctions = vllm_keys_junctions

    def snapshot_slots(self) -> dict[str, tuple[list[int], int]]:
        return dict(self.turn_end.snapshot_slots)

    def junction_stops(self) -> dict[str, int]:
        return {} if self.junctions is None else dict(self.junctions.targets)


def make_extension(settings: Settings, geo: StoreGeometry, metrics: SchedulerMetrics,
                   seal: Seal) -> NoExtension:
    """The scheduler side's extension: :class:`ReuseExtension` when the settings turn any part
    of it on, else :class:`NoExtension`."""
    if settings.reuse_extension:
        return ReuseExtension(settings, geo, metrics, seal)
    return NoExtension()
