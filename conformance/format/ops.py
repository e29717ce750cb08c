"""The op vocabulary of trace format v1: each op's fields, their kinds and defaults.

The loader validates every op against these specs (one-line errors naming the op index and
field); the driver reads the normalised values. Connector ops are merged in from
``conformance/harness/connector_adapter.py`` so the format grows without a break.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Field kinds understood by the loader.
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


@dataclass(frozen=True)
class Field:
    kind: str
    default: Any = REQUIRED


CORE_OPS: dict[str, dict[str, Field]] = {
    "add_request": {"rid": Field(NEW_RID), "tokens": Field(TOKENS), "max_tokens": Field(POS, 16)},
    "new_step": {},
    "lookup": {"rid": Field(RID), "max_len": Field(NAT_OR_NULL, None)},
    "plan_chunk": {
        "rid": Field(RID), "use_hit": Field(BOOL, False), "external": Field(NAT, 0),
        "budget": Field(NAT_OR_NULL, None), "drafts": Field(NAT, 0),
    },
    "allocate": {
        "rid": Field(RID), "n": Field(NAT_OR_PLAN), "use_hit": Field(BOOL, False),
        "external": Field(NAT, 0), "delay_cache": Field(BOOL, False), "lookahead": Field(NAT, 0),
        "reserved": Field(NAT, 0),
    },
    "commit": {"rid": Field(RID), "n": Field(NAT_OR_NULL, None)},
    "rollback": {"rid": Field(RID), "n": Field(NAT)},
    "remote_kv_ready": {"rid": Field(RID)},
    "set_in_flight": {"rid": Field(RID), "n": Field(NAT)},
    "append_output": {"rid": Field(RID), "tokens": Field(TOKENS)},
    "drain_copies": {},
    "release_retained": {"handle": Field(NAT_OR_NULL, None)},
    "drain_offloads": {},
    "finalize_tail": {"rid": Field(RID)},
    "free": {"rid": Field(RID)},
    "preempt": {"rid": Field(RID)},
    "evict": {"blocks": Field(IDS, None), "keys": Field(KEYS, None)},
    "reset": {},
    "truncate": {"rid": Field(RID), "n": Field(NAT)},
    "pool_state": {},
    "table": {"rid": Field(RID)},
}

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


# Op names renamed within format 1: an old trace's op is read under its new name
# (docs/trace-format.md, "Stability").
RENAMED_OPS = {"snapshot": "pool_state"}  # rename: keep (the old name must stay readable)


def all_op_specs() -> dict[str, dict[str, Field]]:
    """Core ops plus the connector ops."""
    return {**CORE_OPS, **CONNECTOR_OP_SPECS}
