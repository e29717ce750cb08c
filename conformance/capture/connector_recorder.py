"""Connector ops for a recorder whose engine runs a KV connector, workers in-process.

Wraps the scheduler's connector -- ``TailproofConnector`` or vLLM 0.33's
``MooncakeStoreConnector``, whose scheduler-side calls are the same --
(``get_num_new_matched_tokens`` -> ``sched_lookup``, ``build_connector_meta`` -> ``conn_step``,
``update_connector_output`` -> ``worker_report``) and each worker rank's ``wait_for_save``
(-> ``worker_run``, once the rank's single sender thread has run the queued jobs; a
``mooncake_ranks.MooncakeRank`` runs them synchronously); the scheduler's
``finalize_partial_tail_offloads`` with the ``remove_skipped_blocks`` that follows it
(``Scheduler._connector_finished``) becomes ``conn_finish``.
Connector ops expect ``free`` (and ``sched_lookup`` what the connector answered: ``ext``,
``async``); their other effects (pins, loads) are checked through ``free`` and every later
core observation. Worker ranks must live in the recording process (the
capture harness), so a multi-process ``vllm serve`` records the core only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

# A refused put batch as the worker sees it, and its ``worker_run.store`` script entry.
REFUSALS = {"full": ("full", -200), "error": ("error", -1), "timeout": ("raise", 0)}


class RefusingStore:
    """One worker's store with scripted refusals: ``plan()`` answers ``ok``, ``full``
    (``MOONCAKE_NO_AVAILABLE_HANDLE``), ``error`` or ``timeout`` for each put batch; a refused
    batch fails every key without reaching the store (fail closed: a miss, never wrong bytes).
    ``entries`` holds the script entries of the batches since the last ``take``."""

    def __init__(self, inner: Any, plan: Callable[[], str]) -> None:
        self.inner = inner
        self.plan = plan
        self.entries: list[str] = []

    def _refused(self, n: int) -> list[Any] | None:
        """The outcomes of a refused batch of ``n`` keys, or None to let it through."""
        from tailproof.impl.stores import Outcome

        what = self.plan()
        if what == "ok":
            self.entries.append("ok")
            return None
        entry, code = REFUSALS[what]
        self.entries.append(entry)
        make = {"full": Outcome.full, "error": Outcome.error, "timeout": Outcome.timeout}[what]
        return [make(code)] * n

    def put_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Any]:
        refused = self._refused(len(keys))
        return self.inner.put_batch(keys, buffers) if refused is None else refused

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Any,
                    staging: Any = None) -> list[Any]:
        refused = self._refused(len(keys))
        if refused is None:
            return self.inner.write_batch(keys, sizes, produce, staging=staging)
        return refused

    def take(self) -> list[str]:
        """The script of the batches run since the last call (trailing ``ok``s dropped: an
        exhausted script means ``ok``)."""
        out, self.entries = self.entries, []
        while out and out[-1] == "ok":
            out.pop()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RecorderHooks(Protocol):
    """What this module needs of the ``Recorder`` (``recorder.py``): the scheduler it wraps,
    ops queued around a call, and the two pieces of state a connector op shares with the core
    recorder. Nothing else of the recorder is reached."""

    scheduler: Any

    def sync(self, request: Any) -> None:
        """Queue the request-side ops a replay needs before a call on ``request``."""

    def sync_known(self, request: Any) -> None:
        """``sync`` for a request the trace holds already."""

    def emit(self, op: dict[str, Any], expect: dict[str, Any]) -> None:
        """Queue one op (``free`` read now)."""

    def inside_op(self) -> AbstractContextManager[None]:
        """Manager calls made inside are part of the op being recorded."""

    @property
    def nested(self) -> bool:
        """Whether a call now is made inside an op being recorded."""

    def absorb_truncate(self, on: bool) -> None:
        """While on, the scheduler's truncate is part of the connector's lookup op."""

    def take_finish_pending(self) -> str | None:
        """The request whose ``conn_finish`` is still to be written, taken once."""


def install(rec: RecorderHooks, workers: list[Any],
            store_plan: Callable[[int], Callable[[], str]] | None = None) -> None:
    """Record ``rec.scheduler``'s connector calls and ``workers``' (rank order) store runs;
    ``store_plan(rank)`` scripts that rank's put outcomes (``RefusingStore``)."""
    sched = rec.scheduler
    conn = sched.connector

    def wrap(obj: Any, name: str, handler: Any) -> None:
        orig = getattr(obj, name)

        def inner(*a: Any, **k: Any) -> Any:
            with rec.inside_op():  # manager calls the connector makes are part of its op
                return orig(*a, **k)

        setattr(obj, name, functools.wraps(orig)(functools.partial(handler, inner)))

    def sched_lookup(orig: Any, request: Any, num_computed_tokens: int) -> Any:
        rec.sync(request)
        out = orig(request, num_computed_tokens)
        rec.emit({"op": "sched_lookup", "rid": request.request_id,
                  "local": num_computed_tokens}, {"ext": out[0], "async": bool(out[1])})
        rec.absorb_truncate(True)  # the scheduler's truncate that follows is part of it
        return out

    def conn_step(orig: Any, so: Any) -> Any:
        out = orig(so)  # free is read after: the step's pins are taken here
        rec.emit({"op": "conn_step", "finished": sorted(so.finished_req_ids),
                  "preempted": sorted(so.preempted_req_ids),
                  "scheduled": dict(so.num_scheduled_tokens)}, {})
        rec.absorb_truncate(False)
        return out

    def worker_report(orig: Any, output: Any) -> Any:
        out = orig(output)
        rec.emit({"op": "worker_report"}, {})
        return out

    def worker_run(rank: int, orig: Any) -> Any:
        if rank == 0:  # the step's commits come before any worker runs its jobs
            for req in list(sched.running):
                rec.sync_known(req)
        out = orig()
        # TailproofConnector's wait_for_save only queues the jobs (one sender thread, FIFO):
        # a worker_run is the jobs run to completion, so the rank is settled before the op
        # is written (a MooncakeRank runs them in wait_for_save).
        side = getattr(workers[rank], "worker_side", None)
        if side is not None and not side.wait_idle(60.0):
            raise RuntimeError(f"worker {rank}: store jobs still running after 60 s")
        op: dict[str, Any] = {"op": "worker_run", "worker": rank}
        script = stores[rank].take() if stores else []
        if script:
            op["store"] = script
        rec.emit(op, {})
        return out

    for rank, wc in enumerate(workers):
        if not hasattr(wc, "worker_side"):
            continue  # a mooncake_ranks.MooncakeRank: one synchronous FIFO
        threads = wc.worker_side.settings.send_threads
        if threads != 1:  # several senders interleave jobs: no FIFO order to record
            raise ValueError(f"workers[{rank}]: send_threads={threads}; connector recording "
                             "needs send_threads=1 (the reference runs one FIFO per worker)")
    stores: list[Any] = []  # RefusingStore or mooncake_ranks.RankStore: take()
    if store_plan is not None:
        for rank, wc in enumerate(workers):
            if hasattr(wc, "refusing_store"):  # a MooncakeRank
                stores.append(wc.refusing_store(store_plan(rank)))
                continue
            side = wc.worker_side
            side.store = RefusingStore(side.store, store_plan(rank))
            stores.append(side.store)
    wrap(conn, "get_num_new_matched_tokens", sched_lookup)
    wrap(conn, "build_connector_meta", conn_step)
    wrap(conn, "update_connector_output", worker_report)
    for rank, wc in enumerate(workers):
        wrap(wc, "wait_for_save", functools.partial(worker_run, rank))


def install_finish_hand_off(rec: RecorderHooks) -> None:
    """``Scheduler._connector_finished`` calls ``finalize_partial_tail_offloads`` and then
    ``remove_skipped_blocks`` before the connector sees the block table: both are the
    ``conn_finish`` op (its ``free`` is read after the second). Installed over the recorder's
    own wrappers (``Recorder.install``), so the call is not counted as unmodelled."""
    mgr = rec.scheduler.kv_cache_manager
    orig = mgr.remove_skipped_blocks

    @functools.wraps(orig)
    def remove_skipped_blocks(*a: Any, **k: Any) -> Any:
        rid = None if rec.nested else rec.take_finish_pending()
        if rid is None:
            return orig(*a, **k)
        with rec.inside_op():
            out = orig(*a, **k)
        rec.emit({"op": "conn_finish", "rid": rid}, {})
        return out

    mgr.remove_skipped_blocks = remove_skipped_blocks
