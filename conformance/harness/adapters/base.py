"""What every connector adapter shares: op dispatch over a ``StepContext``, the scheduler's
per-request bookkeeping around the connector, observation assembly and the loops that only
differ by the connector they drive (worker runs, store seeding, trackers).

An adapter sees the scheduler only through the ``StepContext`` of each op (``driver.py``);
the scheduler rules around the connector come from ``tailproof.reference.connector``
(``arbitrate``, ``ConnectorConfig``). Subclasses run their connector: the hooks at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from tailproof.conformance.format.connector_config import connector_config
from tailproof.conformance.format.ops import CONNECTOR_OPS
from tailproof.conformance.harness.connector_adapter import (
    batch_obs,
    held_obs,
    job_obs,
    offer_arg,
    offload_obs,
    rid_set,
    scheduled_arg,
    workers_arg,
)
from tailproof.conformance.harness.driver import StepContext
from tailproof.reference.connector.config import ConnectorConfig
from tailproof.reference.connector.lookup import arbitrate

# KVTransferConfig.kv_role of a trace's ``config.connector.role``.
KV_ROLE = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}

Tag = tuple[int, int, int, str]  # a stored key's observation tag: (rank, group, boundary, rid)


@dataclass(frozen=True)
class Row:
    """One scheduled request of a ``conn_step``: what ``SchedulerOutput`` says of it."""

    rid: str
    tokens: int  # num_scheduled_tokens
    kind: str  # new | running | resumed
    block_ids: tuple[list[int], ...]  # new requests: the whole table; cached: this step's
    computed: int  # num_computed_tokens


@dataclass(frozen=True)
class ConnStep:
    """One ``conn_step`` as ``build_connector_meta`` receives it."""

    rows: list[Row]
    finished: set[str]
    preempted: set[str]
    offloads: dict[str, list[tuple[int, int, int]]]  # rid -> [(group, block, boundary)]
    ctx: StepContext

    def resolve(self, rid: str) -> tuple[list[int], ...] | None:
        """``KVConnectorBlockState.resolve_block_ids``: the tables of this step's requests
        (scheduled or handing a state off) only."""
        if rid in self.offloads or any(r.rid == rid for r in self.rows):
            return tuple(self.ctx.table(rid))
        return None


def kv_blocks(table: tuple[list[int], ...]) -> SimpleNamespace:
    """A stand-in ``KVCacheBlocks`` with the one method ``update_state_after_alloc`` calls."""
    return SimpleNamespace(get_block_ids=lambda group_ids=None: tuple(
        list(table[g]) for g in (group_ids if group_ids is not None else range(len(table)))))


def store_context(rid: str, hashes: Sequence[bytes], h: int) -> tuple[str, dict[str, int]]:
    """The writer and ``hash hex -> boundary`` map a scripted store tags a job's keys with."""
    return rid, {bytes(x).hex(): (i + 1) * h for i, x in enumerate(hashes)}


class ConnectorAdapter:
    """The connector half of an adapter (see module docstring). ``self.store`` is a scripted
    store with a ``log`` of put batches and ``set_script``; the defaults of ``put_key``,
    ``remove_key`` and ``store_tags`` are those of ``reference.connector.store.ScriptedStore``."""

    ops = CONNECTOR_OPS
    store: Any

    def __init__(self, config: Any) -> None:
        self.trace_config = config
        self.conf = connector_config(config)
        self.role = ConnectorConfig.from_doc(self.conf)
        self.lcm = config.scheduler_block_size
        # EXTENSION (docs/reuse.md): the observations of turn-end checkpoints, only when on.
        self.turn_end = bool(self.conf.get("turn_end_checkpoints"))
        # EXTENSION (docs/junctions.md): the junction a connector lookup set, its copies.
        self.junctions = bool(self.conf.get("junction_checkpoints"))
        self.running: set[str] = set()
        self.preempted: set[str] = set()
        self.externals: dict[str, int] = {}

    @property
    def can_put(self) -> bool:
        return self.role.can_put

    def apply(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        return getattr(self, f"_op_{op['op']}")(op, ctx)

    # --- conn_step ---------------------------------------------------------------------

    def _op_conn_step(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        scheduled = scheduled_arg(op["scheduled"], ctx.scheduled())
        finished = rid_set(op["finished"], "finished")
        preempted = rid_set(op["preempted"], "preempted")
        for rid in finished | preempted:
            self.running.discard(rid)
            self.preempted.discard(rid)
        self.preempted |= preempted
        offloads = ctx.take_offloads()
        for rid, g, b, blk in offer_arg(op["offer"]):
            offloads.setdefault(rid, []).append((g, blk, b))
        rows = []
        for rid, n in scheduled.items():
            if rid in self.preempted:
                kind = "resumed"
            elif rid in self.running:
                kind = "running"
            else:
                kind = "new"
            if kind == "running":
                ids = ctx.allocated(rid)
                block_ids = tuple(list(g) for g in ids) if ids else ()
            else:
                block_ids = tuple(list(g) for g in ctx.table(rid))
                self.after_alloc(ctx.request(rid), block_ids, self.externals.pop(rid, 0))
            rows.append(Row(rid, n, kind, block_ids, ctx.view(rid).num_computed_tokens))
        for rid in scheduled:
            self.preempted.discard(rid)
            self.running.add(rid)
        jobs, loads = self.build(ConnStep(rows, finished, preempted, offloads, ctx))
        out = {"offered": offload_obs(offloads), "jobs": jobs, "loads": loads,
               "held": held_obs(self.held())}
        if self.turn_end or self.junctions:
            out["snapshots"] = [{"rid": r, "group": g, "boundary": b, "src": src, "slot": slot}
                                for r, g, src, slot, b in self.snapshots()]
        return out

    # --- conn_finish -------------------------------------------------------------------

    def _op_conn_finish(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        """``Scheduler._connector_finished`` (SC:3349-3402): finalize (producers only), drop
        out-of-window blocks, clip the tables to the computed tokens, register the tail."""
        rid = op["rid"]
        tails = ctx.finalize_tail(rid) if self.role.is_producer else []
        ctx.remove_skipped(rid)
        block_ids = tuple(ctx.computed_block_ids(rid))
        req = ctx.request(rid)
        job = self.register(req, block_ids, tails) if tails else None
        out: dict[str, Any] = {"tails": [{"group": g, "boundary": b, "block": blk}
                                         for g, blk, b in tails], "delay": False}
        out["job"] = job
        if self.turn_end:  # EXTENSION rule 3: after the partial tail
            out["turn_end"] = self.finish_turn(req, block_ids)
        out["held"] = held_obs(self.held())
        return out

    # --- workers -----------------------------------------------------------------------

    def _op_worker_run(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        w = op["worker"]
        if w >= self.conf["num_workers"]:
            raise ValueError(f"worker {w} out of range")
        jobs = self.run_worker(w, op["n"], op["store"])
        return {"jobs": jobs, **self.worker_state(w)}

    def run_worker(self, w: int, n: int | None, script: Any) -> list[dict[str, Any]]:
        """Run up to ``n`` of worker ``w``'s queued jobs (all when None), one at a time, each
        with the put batches it wrote to the scripted store."""
        self.store.set_script(script)
        out: list[dict[str, Any]] = []
        while n is None or len(out) < n:
            first = len(self.store.log)
            ran = self.run_one(w)
            if ran is None:
                break
            job_id, rid, err = ran
            row: dict[str, Any] = {"job": job_id, "rid": rid, "batches": [
                batch_obs(tags, entry) for tags, entry in self.store.log[first:]]}
            if err is not None:
                row["error"] = err
            out.append(row)
        return out

    def _op_worker_report(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        workers = workers_arg(op["workers"], self.conf["num_workers"])
        total: dict[int, int] = {}
        for w in workers:
            for j, c in self.take_completed(w).items():
                total[j] = total.get(j, 0) + c
        released = self.report(total)
        return {"reported": [[j, c] for j, c in sorted(total.items())], "released": released,
                "held": held_obs(self.held()), "pending_push": bool(self.held())}

    def _released(self, before: set[int], completed: dict[int, int]) -> list[int]:
        """The reported jobs whose pins the report released (held before, not after)."""
        return [j for j in completed if j in before and j not in self.held()]

    # --- lookups -----------------------------------------------------------------------

    def _op_store_lookup(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        n = op["num_tokens"]
        if n is None:
            n = ctx.view(op["rid"]).num_tokens
        hit, tails = self.store_lookup(ctx.request(op["rid"]), n)
        return {"hit": hit, "tails": [list(t) for t in tails]}

    def _op_sched_lookup(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        rid = op["rid"]
        local = op["local"] if op["local"] is not None else ctx.pending_hit(rid)
        ext, load_async = self.matched(ctx.request(rid), local - local % self.lcm)
        if ext is None:
            return {"ext": None}
        arb = arbitrate(local, self.lcm, ext, load_async)
        if arb.truncated:
            ctx.truncate_pending_hit(rid, arb.local)
        self.externals[rid] = arb.external
        out = {"ext": ext, "async": arb.load_async, "local": arb.local,
               "external": arb.external, "truncated": arb.truncated}
        if self.junctions:
            # EXTENSION (docs/junctions.md): the connector lookup may have set the request's
            # Request.shared_prefix_boundary, which the chunk split of this step reads.
            out["junction"] = ctx.view(rid).shared_prefix_boundary
        return out

    # --- store scaffolding and inspection ----------------------------------------------

    def _op_store_seed(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        return {"n": self._seed(op, ctx, remove=False)}

    def _op_store_remove(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        return {"n": self._seed(op, ctx, remove=True)}

    def _seed(self, op: dict[str, Any], ctx: StepContext, remove: bool) -> int:
        """Put (or remove) the keys ``[group, boundary]`` of the request's prefixes on each
        named worker directly; how many keys changed."""
        workers = workers_arg(op["workers"], self.conf["num_workers"])
        rid = op["rid"]
        req = ctx.request(rid)
        h = self.trace_config.hash_block_size
        n = 0
        for r in workers:
            for g, b in op["keys"]:
                key = self.store_key(r, g, req.block_hashes[b // h - 1])
                n += self.remove_key(key) if remove else self.put_key(key, (r, g, b, rid), req)
        return n

    def _op_store_keys(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        return {"store": sorted([list(t) for t in self.store_tags()])}

    def _op_conn_state(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        out = {"held": held_obs(self.held()), "pending_push": bool(self.held()),
               "trackers": self.trackers(),
               "workers": [self.worker_state(w) for w in range(self.conf["num_workers"])]}
        if self.turn_end:
            out["slots"] = {rid: [b, list(ids)] for rid, (ids, b) in sorted(self.slots().items())}
        if self.junctions:
            out["junctions"] = dict(sorted(self.junction_targets().items()))
        return out

    def trackers(self) -> dict[str, dict[str, Any]]:
        """Every ``RequestTracker`` of the scheduler role, by request id."""
        return {rid: {"token_len": t.token_len, "saved": t.num_saved_tokens,
                      "prefill_end": t.prefill_end_tokens, "tail_sent": t.partial_tail_sent}
                for rid, t in sorted(self.request_trackers().items())}

    def job_obs(self, job: Any) -> dict[str, Any]:
        """A store job (``ReqMeta`` / ``MooncakeStoreRequestMeta`` / impl's ``StoreJob``) with
        the blocks its pin holds."""
        pins = self.held().get(job.store_job_id, ([], 0))[0]
        return job_obs(job.store_job_id, job.req_id, job.token_ids_start, job.token_len_chunk,
                       job.publish_partial_tail,
                       [(p.group_id, p.block_id, p.num_tokens) for p in job.boundary_puts or []],
                       pins)

    # --- the scripted store (reference.connector.store.ScriptedStore by default) --------

    def put_key(self, key: Any, tag: Tag, req: Any) -> int:
        self.store.add(key, tag)
        return 1

    def remove_key(self, key: Any) -> int:
        return int(self.store.remove([key]))

    def store_tags(self) -> list[Tag]:
        return list(self.store.keys.values())

    # --- implemented by each adapter ---------------------------------------------------

    def after_alloc(self, req: Any, table: tuple[list[int], ...], external: int) -> None:
        raise NotImplementedError

    def build(self, step: ConnStep) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``build_connector_meta``: the step's store jobs and loads, as observed."""
        raise NotImplementedError

    def held(self) -> dict[int, tuple[list[int], int]]:
        raise NotImplementedError

    def register(self, req: Any, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        raise NotImplementedError

    def run_one(self, w: int) -> tuple[int, str, str | None] | None:
        """Run worker ``w``'s head job: (job id, rid, error class or None); None: no job."""
        raise NotImplementedError

    def worker_state(self, w: int) -> dict[str, Any]:
        raise NotImplementedError

    def take_completed(self, w: int) -> dict[int, int]:
        raise NotImplementedError

    def report(self, completed: dict[int, int]) -> list[int]:
        raise NotImplementedError

    def store_lookup(self, req: Any, n: int) -> tuple[int, list[tuple[int, int]]]:
        raise NotImplementedError

    def matched(self, req: Any, num_computed: int) -> tuple[int | None, bool]:
        raise NotImplementedError

    def store_key(self, rank: int, group: int, block_hash: Any) -> Any:
        """The store key of one prefix of a request on one rank."""
        raise NotImplementedError

    def request_trackers(self) -> dict[str, Any]:
        raise NotImplementedError

    # EXTENSION (docs/reuse.md): called only with turn_end_checkpoints on.

    def snapshots(self) -> list[tuple[str, int, int, int, int]]:
        """The last ``conn_step``'s snapshot copies as ``(rid, group, src, slot, boundary)``."""
        raise NotImplementedError

    def finish_turn(self, req: Any, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        """The turn-end job registered at finish (as in ``jobs``), or None."""
        raise NotImplementedError

    def slots(self) -> dict[str, tuple[list[int], int]]:
        """Snapshot blocks held per request: ``(slot ids in store order, boundary)``."""
        raise NotImplementedError

    # EXTENSION (docs/junctions.md): called only with junction_checkpoints on.

    def junction_targets(self) -> dict[str, int]:
        """Requests whose junction stop is set and whose junction job is still to come."""
        raise NotImplementedError
