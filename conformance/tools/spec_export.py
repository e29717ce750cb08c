"""Export a model action sequence as a conformance trace (trace format 1).

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

``writer(folder)`` is the ``export`` callback of ``tailproof.spec.prove.run`` (``tailproof prove
--export DIR``): it writes each counterexample as ``<name>.json``; a finding's trace ends with one
more step in which the named request looks its prefix up (the lookup that hits the
never-computed blocks).

The steps are written with the harness's step builder (``tailproof.conformance.harness.steps``),
without running; the model says which chunks were scheduled. Observations are left to the
adapters (no ``expect``): the trace checks that the implementations agree on the scenario;
the model's own verdict is in the description.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailproof.conformance.format.trace import FORMAT_TAG
from tailproof.conformance.harness.steps import Steps, op
from tailproof.spec.model import Config, State, initial
from tailproof.spec.proofs.export import mappable, needs_connector
from tailproof.spec.prove import Counterexample, Export


def writer(folder: Path) -> Export:
    """The ``export`` callback that writes each counterexample into ``folder``."""
    def write(cx: Counterexample) -> str:
        doc = to_trace(cx.config, cx.actions, cx.name, cx.description)
        if cx.final_lookup is not None:
            doc["ops"][-1:-1] = [op("new_step"), op("lookup", rid=f"r{cx.final_lookup}")]
        path = folder / f"{cx.name}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return str(path)
    return write


def to_trace(cfg: Config, actions: list[tuple], name: str, description: str) -> dict[str, Any]:
    """The trace document for ``actions`` run from the initial state of ``cfg``."""
    if not mappable(actions):
        raise ValueError("worker ops out of FIFO order")
    conn = needs_connector(actions)
    rid = [f"r{i}" for i in range(len(cfg.prompts))]
    ops = [op("add_request", rid=rid[i], tokens=list(p)) for i, p in enumerate(cfg.prompts)]
    steps = Steps(ops.append, connector=conn)
    commits: list[str] = []  # with a connector, the step's commits come after conn_step
    ended: dict[str, list[str]] = {"finished": [], "preempted": []}
    s: State = initial(cfg)
    for act in actions:
        kind, args = act[0], act[1:]
        if kind == "schedule":
            i = args[0]
            waiting, before = s.reqs[i].status == "waiting", s.reqs[i].computed
            if waiting:
                steps.admit(rid[i], connector_lookup=False)
            else:
                steps.run(rid[i])
            s = s.apply(act)
            if s.reqs[i].status == "running" and (waiting or s.reqs[i].computed != before):
                if conn:
                    commits.append(rid[i])
                else:
                    steps.commit(rid[i])
            continue
        if kind == "end_schedule":
            steps.end(commits, bool(s.pending_copies) and not cfg.defer_block_free, **ended)
            commits, ended = [], {"finished": [], "preempted": []}
        else:
            _write_action(steps, s, kind, args, rid, ended)
        s = s.apply(act)
    for r in commits:
        steps.commit(r)
    ops.append(op("pool_state"))
    if conn:
        ops += [op("conn_state"), op("store_keys")]
    return {"format": FORMAT_TAG, "name": name, "description": description,
            "config": _config(cfg, conn), "ops": ops}


def _write_action(steps: Steps, s: State, kind: str, args: tuple, rid: list[str],
                  ended: dict[str, list[str]]) -> None:
    """The ops of one action other than ``schedule`` and ``end_schedule``."""
    emit = steps.emit
    if kind == "begin_step":
        steps.begin()
    elif kind == "finish":
        steps.finish(rid[args[0]])
        if steps.connector:
            ended["finished"].append(rid[args[0]])
    elif kind == "preempt":
        emit(op("preempt", rid=rid[args[0]]))
        ended["preempted"].append(rid[args[0]])
    elif kind == "run_job":
        emit(op("worker_run", worker=args[1], n=1, store=[args[2]]))
    elif kind == "report":
        emit(op("worker_report", workers=[args[1]]))
    elif kind == "evict":
        emit(op("evict", keys=sorted([g, len(p)] for (g, p), b in s.keys.items() if b == args[0])))
    elif kind in ("reset", "release"):
        emit(op("reset" if kind == "reset" else "release_retained"))


def _config(cfg: Config, conn: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "groups": [{"kind": "full_attention", "block_size": cfg.bs_fa},
                   {"kind": "mamba_align", "block_size": cfg.bs_mamba}],
        "hash_block_size": cfg.h,
        "num_blocks": cfg.num_blocks,
        "use_eagle": cfg.use_eagle,
    }
    if conn:
        config["connector"] = {"role": "producer", "num_workers": cfg.workers}
    return config
