"""Export a model action sequence as a conformance trace (``tailproof-trace/1``).

A counterexample found on a mutated model is a real scenario of the *unmutated* system up to
the step where the seeded rule fires; exporting it gives the conformance suite a case that
drives reference and vLLM to exactly that precondition. Model actions map to core trace ops:

============== ===========================================================================
begin_step     ``new_step``
schedule       waiting: ``lookup``, ``plan_chunk(use_hit)``, ``allocate(n="plan", use_hit)``;
               running: ``plan_chunk``, ``allocate(n="plan")``; then ``commit`` on success
end_schedule   ``drain_offloads``, ``drain_copies``, ``release_retained`` (if copies, no defer)
execute        (nothing: the worker's copies and forward are not core ops)
finish         ``finalize_tail``, ``free``
preempt        ``preempt``
evict          ``evict(keys=...)`` (keys are implementation-independent, block ids are not)
reset          ``reset``
release        ``release_retained`` (deferred retention)
run_job        ``worker_run(worker=rank, n=1, store=[outcome])``   (connector traces)
report         ``worker_report(workers=[rank])``                  (connector traces)
============== ===========================================================================

A sequence with worker actions becomes a connector trace (``config.connector`` = producer with
``W`` workers): ``end_schedule`` then also emits ``conn_step`` (with the finished/preempted
requests since the last one) and the step's ``commit``s move after it, as in vLLM;
``finish`` becomes ``conn_finish`` + ``free``. Worker ops run FIFO per rank in vLLM, so a
sequence that runs a rank's jobs out of order is not mappable.

Observations are left to the adapters (no ``expect``): the trace checks that the
implementations agree on the scenario; the model's own verdict is in the description.
"""

from __future__ import annotations

from typing import Any

from ..model import Config, State, initial

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


def to_trace(cfg: Config, actions: list[tuple], name: str, description: str) -> dict[str, Any]:
    """The trace document for ``actions`` run from the initial state of ``cfg``."""
    if not mappable(actions):
        raise ValueError("worker ops out of FIFO order")
    conn = needs_connector(actions)
    commits: list[dict[str, Any]] = []
    ended: dict[str, list[str]] = {"finished": [], "preempted": []}
    rid = [f"r{i}" for i in range(len(cfg.prompts))]
    ops: list[dict[str, Any]] = [
        {"op": "add_request", "rid": rid[i], "tokens": list(p), "max_tokens": 16}
        for i, p in enumerate(cfg.prompts)
    ]
    s: State = initial(replace_mutant(cfg))
    for act in actions:
        kind, args = act[0], act[1:]
        if kind == "begin_step":
            ops.append({"op": "new_step"})
        elif kind == "schedule":
            i = args[0]
            waiting = s.reqs[i].status == "waiting"
            before = s.reqs[i].computed
            if waiting:
                ops.append({"op": "lookup", "rid": rid[i]})
                ops.append({"op": "plan_chunk", "rid": rid[i], "use_hit": True})
                ops.append({"op": "allocate", "rid": rid[i], "n": "plan", "use_hit": True})
            else:
                ops.append({"op": "plan_chunk", "rid": rid[i]})
                ops.append({"op": "allocate", "rid": rid[i], "n": "plan"})
            t = s.apply(act)
            if t.reqs[i].status == "running" and (waiting or t.reqs[i].computed != before):
                (commits if conn else ops).append({"op": "commit", "rid": rid[i]})
            s = t
            continue
        elif kind == "end_schedule":
            ops.append({"op": "drain_offloads"})
            ops.append({"op": "drain_copies"})
            if s.pending_copies and not cfg.defer_block_free:
                ops.append({"op": "release_retained"})
            if conn:
                ops.append({"op": "conn_step", **ended})
                ended = {"finished": [], "preempted": []}
                ops += commits
                commits = []
        elif kind == "finish":
            if conn:
                ops += [{"op": "conn_finish", "rid": rid[args[0]]},
                        {"op": "free", "rid": rid[args[0]]}]
                ended["finished"].append(rid[args[0]])
            else:
                ops += [{"op": "finalize_tail", "rid": rid[args[0]]},
                        {"op": "free", "rid": rid[args[0]]}]
        elif kind == "preempt":
            ops.append({"op": "preempt", "rid": rid[args[0]]})
            ended["preempted"].append(rid[args[0]])
        elif kind == "run_job":
            ops.append({"op": "worker_run", "worker": args[1], "n": 1, "store": [args[2]]})
        elif kind == "report":
            ops.append({"op": "worker_report", "workers": [args[1]]})
        elif kind == "evict":
            keys = sorted([g, len(p)] for (g, p), b in s.keys.items() if b == args[0])
            ops.append({"op": "evict", "keys": keys})
        elif kind == "reset":
            ops.append({"op": "reset"})
        elif kind == "release":
            ops.append({"op": "release_retained"})
        s = s.apply(act)
    ops += commits
    ops.append({"op": "snapshot"})
    if conn:
        ops += [{"op": "conn_state"}, {"op": "store_keys"}]
    config: dict[str, Any] = {
        "groups": [{"kind": "full_attention", "block_size": cfg.bs_fa},
                   {"kind": "mamba_align", "block_size": cfg.bs_mamba}],
        "hash_block_size": cfg.h,
        "num_blocks": cfg.num_blocks,
        "use_eagle": cfg.use_eagle,
    }
    if conn:
        config["connector"] = {"role": "producer", "num_workers": cfg.workers}
    return {
        "format": "tailproof-trace/1",
        "name": name,
        "description": description,
        "config": config,
        "ops": ops,
    }


def replace_mutant(cfg: Config) -> Config:
    """The unmutated system: the trace shows what the real code does on this scenario."""
    from dataclasses import replace

    return replace(cfg, mutant=None)
