"""The keys each op's observation can carry, on any adapter (``driver.CoreDriver._op_*`` for
the core ops, ``adapters.base.ConnectorAdapter._op_*`` for the connector ops), plus ``free``
(every op) and ``error`` (an op that raised). The loader refuses an ``expect`` key outside
its op's set (``step_protocol``), so ``validate`` and ``replay`` reject the same traces;
``tests/conformance/test_step_protocol.py`` checks the table against the corpus's runs.
"""

from __future__ import annotations

_ALWAYS = frozenset({"free", "error"})

OBSERVES: dict[str, frozenset[str]] = {name: frozenset(keys) | _ALWAYS for name, keys in {
    "add_request": {"num_hashes"},
    "new_step": set(),
    "lookup": {"hit", "blocks", "junction"},
    "plan_chunk": {"chunk"},
    "allocate": {"ok", "new"},
    "commit": {"computed"},
    "rollback": {"computed"},
    "remote_kv_ready": {"computed"},
    "set_in_flight": set(),
    "append_output": {"num_hashes"},
    "drain_copies": {"copies", "retained", "handle"},
    "release_retained": {"released"},
    "drain_offloads": {"offloads"},
    "finalize_tail": {"tails"},
    "free": set(),
    "preempt": set(),
    "evict": {"evicted"},
    "reset": {"ok"},
    "truncate": {"blocks"},
    "pool_state": {"refcounts", "free_queue", "keys"},
    "table": {"blocks"},
    "conn_step": {"offered", "jobs", "loads", "held", "snapshots"},
    "conn_finish": {"tails", "delay", "held", "job", "turn_end"},
    "worker_run": {"jobs", "pressure", "skipped", "offsets", "queued"},
    "worker_report": {"reported", "released", "held", "pending_push"},
    "store_lookup": {"hit", "tails"},
    "sched_lookup": {"ext", "async", "local", "external", "truncated", "junction"},
    "store_seed": {"n"},
    "store_remove": {"n"},
    "store_keys": {"store"},
    "conn_state": {"held", "pending_push", "trackers", "workers", "slots", "junctions"},
}.items()}
