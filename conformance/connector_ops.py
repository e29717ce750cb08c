"""Connector ops of trace format v1 (additive to ``tailproof-trace/1``) and the
``config.connector`` section: field specs, validation, and the observation helpers both
connector adapters share, so that they can differ only in what they do.

See ``docs/connector-ops.md`` for the meaning of every op and observation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tailproof.conformance.ops import ANY, KEYS, NAT, NAT_OR_NULL, RID, Field
from tailproof.reference.connector.config import ConnectorConfig
from tailproof.reference.connector.lookup import arbitrate

if TYPE_CHECKING:
    from tailproof.conformance.driver import CoreDriver

CONNECTOR_OP_SPECS: dict[str, dict[str, Field]] = {
    # build_connector_meta: the step's scheduled requests and hand-offs -> store jobs
    "conn_step": {"scheduled": Field(ANY, None), "finished": Field(ANY, []),
                  "preempted": Field(ANY, []), "offer": Field(ANY, [])},
    # Scheduler._connector_finished: finalize + register_finished_partial_tail (before free)
    "conn_finish": {"rid": Field(RID)},
    # KVCacheStoreSendingThread._handle_request for up to n queued jobs of one worker
    "worker_run": {"worker": Field(NAT, 0), "n": Field(NAT_OR_NULL, None),
                   "store": Field(ANY, [])},
    # build_connector_worker_meta of the named workers -> update_connector_output
    "worker_report": {"workers": Field(ANY, None)},
    # MooncakeStoreWorker.lookup for a request's hashes
    "store_lookup": {"rid": Field(RID), "num_tokens": Field(NAT_OR_NULL, None)},
    # get_num_new_matched_tokens + the scheduler's remote-vs-local rule
    "sched_lookup": {"rid": Field(RID), "local": Field(NAT_OR_NULL, None)},
    # test scaffolding: put / remove store keys of a request's prefixes directly
    "store_seed": {"rid": Field(RID), "keys": Field(KEYS), "workers": Field(ANY, None)},
    "store_remove": {"rid": Field(RID), "keys": Field(KEYS), "workers": Field(ANY, None)},
    # inspection
    "store_keys": {},
    "conn_state": {},
}

CONNECTOR_OPS = frozenset(CONNECTOR_OP_SPECS)

_CONFIG_FIELDS: dict[str, tuple[type, Any]] = {
    "role": (str, "producer"),
    "num_workers": (int, 1),
    "save_decode_cache": (bool, False),
    "enable_lookup": (bool, True),
    "load_async": (bool, False),
}

# The turn-end checkpoint extension (``docs/reuse.md``; not in vLLM 0.33). Written out only when
# given, so a config without them (every vLLM-recorded case, every capture) stays as it is.
EXTENSION_FIELDS: dict[str, tuple[type, Any]] = {
    "turn_end_checkpoints": (bool, False),
    "checkpoint_slots": (int, 32),
    "checkpoint_reserve_blocks": (int, 4),
    "decode_boundary_saves": (bool, False),
    # rule 7 (impl's lookup wait): off in traces unless given (impl's own default is on)
    "checkpoint_lookup_wait": (bool, False),
    # junction checkpoints (docs/junctions.md, "The extension")
    "junction_checkpoints": (bool, False),
    "junction_index_blocks": (int, 1 << 18),
    # with junction_checkpoints: the hook also sets the manager's junction keying
    "device_junctions": (bool, False),
}
JUNCTION_INDEX_MAX = 1 << 24


def _typed(key: str, v: Any, typ: type) -> Any:
    if not (isinstance(v, typ) and (typ is not int or not isinstance(v, bool))):
        raise ValueError(f"{key} must be a {typ.__name__}, got {v!r}")
    return v


def validate_connector_config(doc: dict[str, Any]) -> dict[str, Any]:
    """Normalise ``config.connector``: known keys only, typed, with defaults filled in (the
    extension's keys only when given)."""
    unknown = sorted(set(doc) - set(_CONFIG_FIELDS) - set(EXTENSION_FIELDS))
    if unknown:
        raise ValueError(f"unknown connector key {unknown[0]!r}")
    out: dict[str, Any] = {}
    for key, (typ, default) in _CONFIG_FIELDS.items():
        out[key] = _typed(key, doc.get(key, default), typ)
    for key, (typ, _) in EXTENSION_FIELDS.items():
        if key in doc:
            out[key] = _typed(key, doc[key], typ)
    if out.get("checkpoint_slots", 1) < 1:
        raise ValueError(f"checkpoint_slots must be >= 1, got {out['checkpoint_slots']}")
    if out.get("checkpoint_reserve_blocks", 0) < 0:
        raise ValueError("checkpoint_reserve_blocks must be >= 0, "
                         f"got {out['checkpoint_reserve_blocks']}")
    if not 1 <= out.get("junction_index_blocks", 1) <= JUNCTION_INDEX_MAX:
        raise ValueError(f"junction_index_blocks must be in 1..{JUNCTION_INDEX_MAX}, "
                         f"got {out['junction_index_blocks']}")
    if out["role"] not in ("producer", "consumer", "both"):
        raise ValueError(f"role must be producer, consumer or both, got {out['role']!r}")
    if not 1 <= out["num_workers"] <= 8:
        raise ValueError(f"num_workers must be in 1..8, got {out['num_workers']}")
    return out


_EXTENSION_SWITCHES = {
    "turn_end_checkpoints": "the turn-end checkpoint extension (docs/reuse.md)",
    "decode_boundary_saves": "the turn-end checkpoint extension (docs/reuse.md)",
    "junction_checkpoints": "the junction checkpoint extension (docs/junctions.md)",
}


def extension_on(conf: dict[str, Any] | None) -> bool:
    """Whether a (normalised) connector section turns on a rule of the reuse extension
    (turn-end checkpoints, ``docs/reuse.md``; junction checkpoints, ``docs/junctions.md``),
    which vLLM 0.33's connectors do not have."""
    return bool(conf) and any(conf.get(k) for k in _EXTENSION_SWITCHES)


def extension_refusal(config: Any) -> str | None:
    """Why a vLLM adapter cannot run a trace: its connector section turns on the extension
    (running it would silently ignore the setting). None when it can."""
    conf = getattr(config, "connector", None)
    if not extension_on(conf):
        return None
    on = [k for k in _EXTENSION_SWITCHES if conf.get(k)]
    return (f"config.connector.{on[0]} is on: {_EXTENSION_SWITCHES[on[0]]} "
            f"is not in vLLM 0.33; only reference and impl run it")


def connector_config(config: Any) -> dict[str, Any]:
    """The normalised connector section of a ``TraceConfig`` (defaults when absent)."""
    return validate_connector_config(dict(getattr(config, "connector", None) or {}))


# --- op argument checks (ANY fields) ----------------------------------------------------


def _rid_list(v: Any, name: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"{name} must be a list of request ids")
    return list(v)


def scheduled_arg(v: Any, default: dict[str, int]) -> dict[str, int]:
    """``conn_step.scheduled``: {rid: tokens}, or null for the driver's allocations this step."""
    if v is None:
        return dict(default)
    if not isinstance(v, dict) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in v.items()):
        raise ValueError("scheduled must be an object {rid: tokens}")
    return dict(v)


def offer_arg(v: Any) -> list[tuple[str, int, int, int]]:
    """``conn_step.offer``: extra hand-offs ``[[rid, group, boundary, block], ...]`` that the
    core never produces (a null block, a non-Mamba group): what a connector must refuse."""
    if not isinstance(v, list) or not all(
            isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e[1:])
            for e in v):
        raise ValueError("offer must be a list of [rid, group, boundary, block]")
    return [(e[0], e[1], e[2], e[3]) for e in v]


def rid_set(v: Any, name: str) -> set[str]:
    return set(_rid_list(v, name))


def workers_arg(v: Any, num_workers: int) -> list[int]:
    if v is None:
        return list(range(num_workers))
    if not isinstance(v, list) or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < num_workers for w in v):
        raise ValueError(f"workers must be a list of ints in 0..{num_workers - 1}")
    return list(v)


# --- observation helpers ------------------------------------------------------------------


def put_obs(puts: list[tuple[int, int, int]]) -> list[dict[str, int]]:
    """Boundary puts as {group, boundary, block} (``block`` is renamed in loose mode)."""
    return [{"group": g, "boundary": b, "block": blk} for g, blk, b in puts]


def job_obs(job_id: int | None, rid: str, start: int, end: int, publish: bool,
            puts: list[tuple[int, int, int]], pins: list[int]) -> dict[str, Any]:
    return {"job": job_id, "rid": rid, "start": start, "end": end, "publish": publish,
            "puts": put_obs(puts), "pins": list(pins)}


def held_obs(pinned: dict[int, tuple[list[int], int]]) -> list[list[int]]:
    """Live store jobs as [job, ranks yet to report] (their block ids are in ``pins``)."""
    return [[j, r] for j, (_, r) in sorted(pinned.items())]


def batch_obs(tags: list[tuple[int, int, int, str]], entry: Any) -> dict[str, Any]:
    """One put batch of a job: its keys as [group, boundary] and the scripted result."""
    return {"put": [[g, b] for _, g, b, _ in tags], "result": entry}


def offload_obs(offloads: dict[str, list[tuple[int, int, int]]]) -> list[dict[str, Any]]:
    return [{"rid": rid, "group": g, "boundary": b, "block": blk}
            for rid, entries in offloads.items() for g, blk, b in entries]


class ConnectorAdapter:
    """What both connector adapters share: op dispatch, the scheduler's per-request
    bookkeeping around the connector (new / running / resumed, the external tokens chosen by
    the last ``sched_lookup``), and observation assembly. Subclasses run the model.

    One way: ops come in with the driver, whose step bookkeeping and core backend are read
    through their explicit methods only; the scheduler rules around the connector come from
    ``tailproof.reference.connector`` (``arbitrate``, ``ConnectorConfig``) and the core
    backend (``block_ids_for_computed_tokens``, ``truncate_pending``)."""

    ops = CONNECTOR_OPS

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

    def apply(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        return getattr(self, f"_op_{op['op']}")(op, driver)

    # --- conn_step ---------------------------------------------------------------------

    def _op_conn_step(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        scheduled = scheduled_arg(op["scheduled"], driver.step_scheduled)
        finished = rid_set(op["finished"], "finished")
        preempted = rid_set(op["preempted"], "preempted")
        for rid in finished | preempted:
            self.running.discard(rid)
            self.preempted.discard(rid)
        self.preempted |= preempted
        offloads = driver.take_step_offloads()
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
                ids = driver.step_allocations.get(rid)
                block_ids = tuple(list(g) for g in ids) if ids else ()
            else:
                block_ids = tuple(list(g) for g in driver.core.table(rid))
                self.after_alloc(rid, block_ids, self.externals.pop(rid, 0))
            computed = driver.core.get(rid).num_computed_tokens
            rows.append((rid, n, kind, block_ids, computed))
        for rid in scheduled:
            self.preempted.discard(rid)
            self.running.add(rid)
        req_ids = set(scheduled) | set(offloads)

        def table(rid: str) -> tuple[list[int], ...] | None:
            return tuple(driver.core.table(rid)) if rid in req_ids else None

        jobs, loads = self.build(rows, finished, preempted, offloads, table)
        out = {"offered": offload_obs(offloads), "jobs": jobs, "loads": loads,
               "held": held_obs(self.pinned())}
        if self.turn_end or self.junctions:
            out["snapshots"] = [{"rid": r, "group": g, "boundary": b, "src": src, "slot": slot}
                                for r, g, src, slot, b in self.snapshots()]
        return out

    # --- conn_finish -------------------------------------------------------------------

    def _op_conn_finish(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        """``Scheduler._connector_finished`` (SC:3349-3402): finalize (producers only), drop
        out-of-window blocks, clip the tables to the computed tokens, register the tail."""
        rid = op["rid"]
        core = driver.core
        tails = core.finalize_tail(rid) if self.role.is_producer else []
        core.remove_skipped(rid)
        block_ids = tuple(core.block_ids_for_computed_tokens(rid))
        job = self.register(rid, block_ids, tails) if tails else None
        out: dict[str, Any] = {"tails": [{"group": g, "boundary": b, "block": blk}
                                         for g, blk, b in tails], "delay": False}
        out["job"] = job
        if self.turn_end:  # EXTENSION rule 3: after the partial tail
            out["turn_end"] = self.finish_turn(rid, block_ids)
        out["held"] = held_obs(self.pinned())
        return out

    # --- workers -----------------------------------------------------------------------

    def _op_worker_run(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        w = op["worker"]
        if w >= self.conf["num_workers"]:
            raise ValueError(f"worker {w} out of range")
        script = op["store"]
        jobs = self.run_worker(w, op["n"], script)
        return {"jobs": jobs, **self.worker_state(w)}

    def _op_worker_report(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        workers = workers_arg(op["workers"], self.conf["num_workers"])
        total: dict[int, int] = {}
        for w in workers:
            for j, c in self.take_completed(w).items():
                total[j] = total.get(j, 0) + c
        released = self.report(total)
        return {"reported": [[j, c] for j, c in sorted(total.items())], "released": released,
                "held": held_obs(self.pinned()), "pending_push": bool(self.pinned())}

    # --- lookups -----------------------------------------------------------------------

    def _op_store_lookup(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        n = op["num_tokens"]
        if n is None:
            n = driver.core.get(op["rid"]).num_tokens
        hit, tails = self.store_lookup(op["rid"], n)
        return {"hit": hit, "tails": [list(t) for t in tails]}

    def _op_sched_lookup(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        rid = op["rid"]
        local = op["local"] if op["local"] is not None else driver.pending_hit(rid)
        ext, load_async = self.matched(rid, local - local % self.lcm)
        if ext is None:
            return {"ext": None}
        arb = arbitrate(local, self.lcm, ext, load_async)
        if arb.truncated:
            driver.truncate_pending_hit(rid, arb.local)
        self.externals[rid] = arb.external
        out = {"ext": ext, "async": arb.load_async, "local": arb.local,
               "external": arb.external, "truncated": arb.truncated}
        if self.junctions:
            # EXTENSION (docs/junctions.md): the connector lookup may have set the request's
            # Request.shared_prefix_boundary, which the chunk split of this step reads.
            out["junction"] = driver.core.get(rid).shared_prefix_boundary
        return out

    # --- store scaffolding and inspection ----------------------------------------------

    def _op_store_seed(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        workers = workers_arg(op["workers"], self.conf["num_workers"])
        return {"n": self.seed(op["rid"], [tuple(k) for k in op["keys"]], workers,
                               remove=False)}

    def _op_store_remove(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        workers = workers_arg(op["workers"], self.conf["num_workers"])
        return {"n": self.seed(op["rid"], [tuple(k) for k in op["keys"]], workers,
                               remove=True)}

    def _op_store_keys(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        return {"store": sorted([list(t) for t in self.store_tags()])}

    def _op_conn_state(self, op: dict[str, Any], driver: CoreDriver) -> dict[str, Any]:
        out = {"held": held_obs(self.pinned()), "pending_push": bool(self.pinned()),
               "trackers": self.trackers(),
               "workers": [self.worker_state(w) for w in range(self.conf["num_workers"])]}
        if self.turn_end:
            out["slots"] = {rid: [b, list(ids)] for rid, (ids, b) in sorted(self.slots().items())}
        if self.junctions:
            out["junctions"] = dict(sorted(self.junction_targets().items()))
        return out

    # --- implemented by each adapter ---------------------------------------------------

    def after_alloc(self, rid: str, table: tuple[list[int], ...], external: int) -> None:
        raise NotImplementedError

    def build(self, rows: list[tuple[str, int, str, tuple[list[int], ...], int]],
              finished: set[str], preempted: set[str],
              offloads: dict[str, list[tuple[int, int, int]]],
              table: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        raise NotImplementedError

    def pinned(self) -> dict[int, tuple[list[int], int]]:
        raise NotImplementedError

    def register(self, rid: str, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        raise NotImplementedError

    def run_worker(self, w: int, n: int | None, script: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def worker_state(self, w: int) -> dict[str, Any]:
        raise NotImplementedError

    def take_completed(self, w: int) -> dict[int, int]:
        raise NotImplementedError

    def report(self, completed: dict[int, int]) -> list[int]:
        raise NotImplementedError

    def store_lookup(self, rid: str, n: int) -> tuple[int, list[tuple[int, int]]]:
        raise NotImplementedError

    def matched(self, rid: str, num_computed: int) -> tuple[int | None, bool]:
        raise NotImplementedError

    def seed(self, rid: str, keys: list[tuple[int, ...]], workers: list[int],
             remove: bool) -> int:
        raise NotImplementedError

    def store_tags(self) -> list[tuple[int, int, int, str]]:
        raise NotImplementedError

    def trackers(self) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    # EXTENSION (docs/reuse.md): called only with turn_end_checkpoints on.

    def snapshots(self) -> list[tuple[str, int, int, int, int]]:
        """The last ``conn_step``'s snapshot copies as ``(rid, group, src, slot, boundary)``."""
        raise NotImplementedError

    def finish_turn(self, rid: str, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        """The turn-end job registered at finish (as in ``jobs``), or None."""
        raise NotImplementedError

    def slots(self) -> dict[str, tuple[list[int], int]]:
        """Snapshot blocks held per request: ``(slot ids in store order, boundary)``."""
        raise NotImplementedError

    # EXTENSION (docs/junctions.md): called only with junction_checkpoints on.

    def junction_targets(self) -> dict[str, int]:
        """Requests whose junction stop is set and whose junction job is still to come."""
        raise NotImplementedError
