"""Connector ops for a recorder whose engine runs a KV connector, workers in-process.

Wraps the scheduler's connector (``get_num_new_matched_tokens`` -> ``sched_lookup``,
``build_connector_meta`` -> ``conn_step``, ``update_connector_output`` -> ``worker_report``)
and each worker connector's ``wait_for_save`` (-> ``worker_run``); the scheduler's
``finalize_partial_tail_offloads`` (``Scheduler._connector_finished``) becomes ``conn_finish``.
Connector ops expect ``free`` only: their effect (pins, loads) is checked through it and
through every later core observation. Worker ranks must live in the recording process (the
capture harness), so a multi-process ``vllm serve`` records the core only.
"""

from __future__ import annotations

import functools
from typing import Any


def install(rec: Any, workers: list[Any]) -> None:
    """Record ``rec.scheduler``'s connector calls and ``workers``' (rank order) store runs."""
    sched = rec.scheduler
    conn = sched.connector
    absorb = [False]  # the scheduler's truncate after a connector lookup is part of it

    def wrap(obj: Any, name: str, handler: Any) -> None:
        orig = getattr(obj, name)

        def inner(*a: Any, **k: Any) -> Any:
            rec._depth += 1  # manager calls the connector makes are part of its op
            try:
                return orig(*a, **k)
            finally:
                rec._depth -= 1

        setattr(obj, name, functools.wraps(orig)(functools.partial(handler, inner)))

    def sched_lookup(orig: Any, request: Any, num_computed_tokens: int) -> Any:
        rec._sync(request)
        out = orig(request, num_computed_tokens)
        rec._emit({"op": "sched_lookup", "rid": request.request_id,
                   "local": num_computed_tokens}, {})
        absorb[0] = True
        return out

    def conn_step(orig: Any, so: Any) -> Any:
        out = orig(so)  # free is read after: the step's pins are taken here
        rec._emit({"op": "conn_step", "finished": sorted(so.finished_req_ids),
                   "preempted": sorted(so.preempted_req_ids),
                   "scheduled": dict(so.num_scheduled_tokens)}, {})
        absorb[0] = False
        return out

    def worker_report(orig: Any, output: Any) -> Any:
        out = orig(output)
        rec._emit({"op": "worker_report"}, {})
        return out

    def worker_run(rank: int, orig: Any) -> Any:
        if rank == 0:  # the step's commits come before any worker runs its jobs
            for req in list(sched.running):
                if req.request_id in rec.shadows:
                    rec._sync(req)
        out = orig()
        rec._emit({"op": "worker_run", "worker": rank}, {})
        return out

    wrap(conn, "get_num_new_matched_tokens", sched_lookup)
    wrap(conn, "build_connector_meta", conn_step)
    wrap(conn, "update_connector_output", worker_report)
    for rank, wc in enumerate(workers):
        wrap(wc, "wait_for_save", functools.partial(worker_run, rank))

    truncate = rec._on_truncate_computed_blocks

    def on_truncate(orig: Any, blocks: Any, num_tokens: int) -> Any:
        if absorb[0]:
            return orig(blocks, num_tokens)
        return truncate(orig, blocks, num_tokens)

    def on_finish(orig: Any, request: Any) -> Any:
        rec._sync(request)
        out = orig(request)
        rec._emit({"op": "conn_finish", "rid": request.request_id}, {})
        return out

    rec._on_truncate_computed_blocks = on_truncate
    rec._on_finalize_partial_tail_offloads = on_finish
