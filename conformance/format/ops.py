"""The op vocabulary of trace format v1, each op declared once (:data:`OPS`): its fields with
their kinds and defaults, the keys its observation can carry, which of those hold block ids,
and what it calls.

Everything else about an op derives from its declaration: the loader's validation (fields and
kinds, ``trace.OpReader``), the observation keys an ``expect`` may write
(``observations.OBSERVES``, ``step_protocol``), the block-id renaming of loose comparison
(``compare.Renamer``) and the shipped JSON Schema (``schema.trace_schema``, written to
``conformance/schema/trace.schema.json``). An op's behaviour lives with its handler: the core
ops in ``harness/driver.CoreDriver._op_<name>`` (every adapter), the connector ops in
``harness/adapters/base.ConnectorAdapter._op_<name>`` (every adapter with a connector;
``tests/conformance/test_op_declarations.py`` checks each op has a handler on every adapter or
a stated refusal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Field kinds understood by the loader (``field_problem``) and the schema (``KIND_SCHEMAS``).
RID = "rid"  # id of a request added earlier by add_request
NEW_RID = "new_rid"  # a request id (add_request)
NAT = "nat"  # int >= 0
POS = "pos"  # int >= 1
NAT_OR_NULL = "nat_or_null"
NAT_OR_PLAN = "nat_or_plan"  # int >= 0 or the string "plan"
BOOL = "bool"
TOKENS = "tokens"  # compact token list (conformance/format/tokens.py)
IDS = "ids"  # list of block ids
KEYS = "keys"  # list of [group, boundary]
ANY = "any"  # free-form JSON (validated by the op's owner)

REQUIRED = object()

_NAT: dict[str, Any] = {"type": "integer", "minimum": 0}
# JSON Schema of each kind's value (a nullable kind admits null: its default is None).
KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    RID: {"type": "string", "minLength": 1},
    NEW_RID: {"type": "string", "minLength": 1},
    NAT: _NAT,
    POS: {"type": "integer", "minimum": 1},
    NAT_OR_NULL: {"type": ["integer", "null"], "minimum": 0},
    NAT_OR_PLAN: {"anyOf": [_NAT, {"const": "plan"}]},
    BOOL: {"type": "boolean"},
    TOKENS: {"$ref": "#/$defs/tokens"},
    IDS: {"type": ["array", "null"], "items": _NAT},
    KEYS: {"type": ["array", "null"],
           "items": {"type": "array", "items": _NAT, "minItems": 2, "maxItems": 2}},
    ANY: {},
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def field_problem(kind: str, v: Any) -> str | None:
    """What is wrong with ``v`` as a value of ``kind`` (None: it fits). TOKENS are checked by
    ``tokens.expand``, ANY by the op's owner."""
    if kind in (RID, NEW_RID):
        return None if isinstance(v, str) and v else "must be a non-empty string"
    if kind == NAT:
        return None if _is_int(v) and v >= 0 else f"must be an int >= 0, got {v!r}"
    if kind == POS:
        return None if _is_int(v) and v >= 1 else f"must be an int >= 1, got {v!r}"
    if kind == NAT_OR_NULL:
        ok = v is None or (_is_int(v) and v >= 0)
        return None if ok else f"must be null or an int >= 0, got {v!r}"
    if kind == NAT_OR_PLAN:
        ok = v == "plan" or (_is_int(v) and v >= 0)
        return None if ok else f"must be an int >= 0 or \"plan\", got {v!r}"
    if kind == BOOL:
        return None if isinstance(v, bool) else "must be a bool"
    if kind == IDS:
        ok = v is None or (isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v))
        return None if ok else "must be a list of block ids"
    if kind == KEYS:
        ok = v is None or (isinstance(v, list) and all(
            isinstance(k, list) and len(k) == 2 and all(_is_int(x) and x >= 0 for x in k)
            for k in v))
        return None if ok else "must be a list of [group, boundary]"
    return None


@dataclass(frozen=True)
class Field:
    kind: str
    default: Any = REQUIRED


# Every observation may carry these: ``free`` (the free-block count after the op, every op) and
# ``error`` (the exception class of an op that raised).
ALWAYS_OBSERVED = frozenset({"free", "error"})


@dataclass(frozen=True)
class Op:
    """One op: what it calls (``calls``), its fields, the keys of its observation (besides
    :data:`ALWAYS_OBSERVED`) and, among those at any depth, the ones that hold block ids:
    ``ids`` (ids, or lists of them), ``id_pairs`` (``[[id, n], ...]``), ``id_triples``
    (``[[group, boundary, id], ...]``). ``connector``: run by an adapter's connector."""

    calls: str
    fields: dict[str, Field] = field(default_factory=dict)
    observes: frozenset[str] = frozenset()
    ids: frozenset[str] = frozenset()
    id_pairs: frozenset[str] = frozenset()
    id_triples: frozenset[str] = frozenset()
    connector: bool = False


def _op(calls: str, fields: dict[str, Field] | None = None, observes: str = "", ids: str = "",
        connector: bool = False, **kw: str) -> Op:
    """An :class:`Op` with its key sets written as space-separated names."""
    sets = {k: frozenset(v.split()) for k, v in kw.items()}
    return Op(calls, fields or {}, frozenset(observes.split()), frozenset(ids.split()),
              connector=connector, **sets)


_RID = {"rid": Field(RID)}

OPS: dict[str, Op] = {
    # --- core ops: the scheduler's calls on vLLM's KVCacheManager (docs/trace-format.md)
    "add_request": _op("Request(..., block_hasher=...)",
                       {"rid": Field(NEW_RID), "tokens": Field(TOKENS),
                        "max_tokens": Field(POS, 16)}, "num_hashes"),
    "new_step": _op("KVCacheManager.new_step_starts"),
    "lookup": _op("KVCacheManager.get_computed_blocks",
                  {**_RID, "max_len": Field(NAT_OR_NULL, None)}, "hit blocks junction",
                  ids="blocks"),
    "plan_chunk": _op("the scheduler's chunk sizing",
                      {**_RID, "use_hit": Field(BOOL, False), "external": Field(NAT, 0),
                       "budget": Field(NAT_OR_NULL, None), "drafts": Field(NAT, 0)}, "chunk"),
    "allocate": _op("KVCacheManager.allocate_slots",
                    {**_RID, "n": Field(NAT_OR_PLAN), "use_hit": Field(BOOL, False),
                     "external": Field(NAT, 0), "delay_cache": Field(BOOL, False),
                     "lookahead": Field(NAT, 0), "reserved": Field(NAT, 0)}, "ok new",
                    ids="new"),
    "commit": _op("Scheduler._update_after_schedule",
                  {**_RID, "n": Field(NAT_OR_NULL, None)}, "computed"),
    "rollback": _op("update_from_output: rejected drafts off num_computed_tokens",
                    {**_RID, "n": Field(NAT)}, "computed"),
    "remote_kv_ready": _op("Scheduler._update_waiting_for_remote_kv", _RID, "computed"),
    "set_in_flight": _op("Request.num_in_flight_tokens", {**_RID, "n": Field(NAT)}),
    "append_output": _op("Request.append_output_token_ids",
                         {**_RID, "tokens": Field(TOKENS)}, "num_hashes"),
    "drain_copies": _op("take_kv_cache_block_copies", None, "copies retained handle",
                        ids="copies retained"),
    "release_retained": _op("BlockPool.free_blocks(retained)",
                            {"handle": Field(NAT_OR_NULL, None)}, "released", ids="released"),
    "drain_offloads": _op("take_boundary_state_offloads", None, "offloads", ids="block"),
    "finalize_tail": _op("finalize_partial_tail_offloads", _RID, "tails", ids="block"),
    "free": _op("KVCacheManager.free", _RID),
    "preempt": _op("the block side of Scheduler._preempt_request", _RID),
    "evict": _op("KVCacheManager.evict_blocks",
                 {"blocks": Field(IDS, None), "keys": Field(KEYS, None)}, "evicted",
                 ids="evicted"),
    "reset": _op("KVCacheManager.reset_prefix_cache", None, "ok"),
    "truncate": _op("truncate_computed_blocks of the pending hit", {**_RID, "n": Field(NAT)},
                    "blocks", ids="blocks"),
    "pool_state": _op("walk the block pool", None, "refcounts free_queue keys",
                      ids="free_queue", id_pairs="refcounts", id_triples="keys"),
    "table": _op("KVCacheManager.get_block_ids", _RID, "blocks", ids="blocks"),
    # --- connector ops: the connector's scheduler and worker roles (docs/connector-ops.md)
    "conn_step": _op("build_connector_meta: the step's scheduled requests and hand-offs -> "
                     "store jobs",
                     {"scheduled": Field(ANY, None), "finished": Field(ANY, []),
                      "preempted": Field(ANY, []), "offer": Field(ANY, [])},
                     "offered jobs loads held snapshots", ids="block pins src",
                     connector=True),
    "conn_finish": _op("Scheduler._connector_finished: finalize + "
                       "register_finished_partial_tail (before free)", _RID,
                       "tails delay held job turn_end", ids="block pins", connector=True),
    "worker_run": _op("KVCacheStoreSendingThread._handle_request for up to n queued jobs of "
                      "one worker",
                      {"worker": Field(NAT, 0), "n": Field(NAT_OR_NULL, None),
                       "store": Field(ANY, [])},
                      "jobs pressure skipped offsets queued", connector=True),
    # ``released``: the job ids whose pins went (renamed with the block ids, as always).
    "worker_report": _op("build_connector_worker_meta of the named workers -> "
                         "update_connector_output", {"workers": Field(ANY, None)},
                         "reported released held pending_push", ids="released",
                         connector=True),
    "store_lookup": _op("MooncakeStoreWorker.lookup for a request's hashes",
                        {**_RID, "num_tokens": Field(NAT_OR_NULL, None)}, "hit tails",
                        connector=True),
    "sched_lookup": _op("get_num_new_matched_tokens + the scheduler's remote-vs-local rule",
                        {**_RID, "local": Field(NAT_OR_NULL, None)},
                        "ext async local external truncated junction", connector=True),
    "store_seed": _op("test scaffolding: put store keys of a request's prefixes directly",
                      {**_RID, "keys": Field(KEYS), "workers": Field(ANY, None)}, "n",
                      connector=True),
    "store_remove": _op("test scaffolding: remove store keys of a request's prefixes",
                        {**_RID, "keys": Field(KEYS), "workers": Field(ANY, None)}, "n",
                        connector=True),
    "store_keys": _op("inspection: the store's keys", None, "store", connector=True),
    "conn_state": _op("inspection: the connector's state", None,
                      "held pending_push trackers workers slots junctions", connector=True),
}

# Op names renamed within format 1: an old trace's op is read under its new name
# (docs/trace-format.md, "Stability").
RENAMED_OPS = {"snapshot": "pool_state"}  # rename: keep (the old name must stay readable)

# Derived views, for the loader, the driver and the adapters.
CORE_OPS: dict[str, dict[str, Field]] = {n: o.fields for n, o in OPS.items() if not o.connector}
CONNECTOR_OP_SPECS: dict[str, dict[str, Field]] = {n: o.fields for n, o in OPS.items()
                                                   if o.connector}
CONNECTOR_OPS = frozenset(CONNECTOR_OP_SPECS)


def all_op_specs() -> dict[str, dict[str, Field]]:
    """Every op's fields, core ops then connector ops."""
    return {n: o.fields for n, o in OPS.items()}
