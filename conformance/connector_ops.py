"""Connector ops of trace format v1 (additive to ``tailproof-trace/1``) and the
``config.connector`` section: field specs, validation, and the observation helpers every
connector adapter shares (through ``adapters.base.ConnectorAdapter``), so that they can
differ only in what they do.

See ``docs/connector-ops.md`` for the meaning of every op and observation.
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.ops import ANY, KEYS, NAT, NAT_OR_NULL, RID, Field

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
    # tailproof's pin rules (reference/connector/scheduler.py, DEVIATIONS; not vLLM 0.33): off
    # in traces unless given (impl's own defaults are on: true, 0.25)
    "readable_pins": (bool, False),
    "pin_budget_fraction": (float, None),
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
    frac = out.get("pin_budget_fraction")
    if frac is not None and not 0 < frac <= 1:
        raise ValueError(f"pin_budget_fraction must be in (0, 1], got {frac}")
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


#: connector keys of tailproof's own pin rules, which vLLM 0.33's connector does not have
DEVIATION_SWITCHES = {
    "readable_pins": "tailproof's readable-pins rule (reference/connector/scheduler.py)",
    "pin_budget_fraction": "tailproof's pin budget (reference/connector/scheduler.py)",
}


def extension_refusal(config: Any) -> str | None:
    """Why a vLLM adapter cannot run a trace: its connector section turns on the extension or
    one of tailproof's pin rules (running it would silently ignore the setting). None when it
    can."""
    conf = getattr(config, "connector", None)
    for key, what in DEVIATION_SWITCHES.items():
        if conf and conf.get(key) not in (None, False):
            return (f"config.connector.{key} is set: {what} is not in vLLM 0.33; only "
                    "reference and impl run it")
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
