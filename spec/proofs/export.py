"""Which model action sequences map to conformance traces (the pure half of the exporter).

The trace writer itself is ``tailproof.conformance.tools.spec_export``: writing trace ops is the
harness's job, so the spec imports nothing from it: ``tailproof.spec.prove.run`` hands each
counterexample to an ``export`` callback, which ``prove --export`` fills with the writer.
"""

from __future__ import annotations

WORKER_OPS = frozenset({"run_job", "report"})


def needs_connector(actions: list[tuple]) -> bool:
    """Whether the sequence uses worker ops (a connector trace)."""
    return any(a[0] in WORKER_OPS for a in actions)


def mappable(actions: list[tuple]) -> bool:
    """Whether every action has a trace op: worker ops must run each rank's jobs in job order
    (vLLM's sending thread is FIFO)."""
    last: dict[int, int] = {}
    for a in actions:
        if a[0] == "run_job":
            jid, rank = a[1], a[2]
            if jid < last.get(rank, -1):
                return False
            last[rank] = jid
    return True
