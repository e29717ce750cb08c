"""``tailproof capture``: run a named workload on vLLM's real Scheduler and record it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tailproof.conformance.capture.recorder import Recorder
from tailproof.conformance.harness.vllm_compat import installed_release
from tailproof.conformance.tools.capture_engine.engine import DEFAULT_GROUPS, CaptureEngine
from tailproof.conformance.tools.capture_engine.workloads import GEOMETRIES, WORKLOADS

CONNECTORS = ("none", "tailproof", "mooncake")
_CONNECTOR_DESC = {
    "tailproof": "TailproofConnector (memory store, {n} in-process worker rank(s))",
    "mooncake": "vLLM {release}'s MooncakeStoreConnector (embedded in-memory store in place of a "
                "Mooncake master, {n} in-process worker rank(s), loads landing in the step "
                "that issued them)",
}


class CaptureError(ValueError):
    """Bad capture arguments (unknown workload, geometry or connector)."""


@dataclass
class CaptureResult:
    path: Path
    ops: int
    steps: int
    unmodelled: dict[str, int]


#: Workloads that cannot run with vLLM's own connector, and why (vLLM 0.33 behaviour; 0.34
#: still preempts outside schedule(), and then also trips an assert: docs/triage.md).
#: ``TailproofConnector`` issues those loads (``impl.scheduler_side``, "re-admission").
MOONCAKE_UNSUPPORTED = {
    "resend": "vLLM 0.33's reset_prefix_cache(reset_running_requests=True) preempts outside "
              "schedule(), so the next step re-admits those requests with an asynchronous load "
              "and reports them as preempted in the same SchedulerOutput; vLLM's "
              "MooncakeStoreConnector drops a preempted request's load and they wait in "
              "WAITING_FOR_REMOTE_KVS forever (docs/triage.md)",
}


def check_arguments(workload: str, connector: str, geometry: str | None) -> None:
    """Raise ``CaptureError`` naming the first argument that is not known."""
    if workload not in WORKLOADS:
        raise CaptureError(f"--workload: unknown workload {workload!r} "
                           f"(known: {', '.join(WORKLOADS)})")
    if connector not in CONNECTORS:
        raise CaptureError(f"--connector: {connector!r} is not supported (supported: "
                           f"{', '.join(CONNECTORS)})")
    if connector == "none" and WORKLOADS[workload].num_workers is not None:
        raise CaptureError(f"--connector: workload {workload!r} runs the KV connector; "
                           "pass --connector tailproof or mooncake")
    if connector == "mooncake" and workload in MOONCAKE_UNSUPPORTED:
        raise CaptureError(f"--connector: workload {workload!r} cannot run with mooncake: "
                           f"{MOONCAKE_UNSUPPORTED[workload]} (fix: --connector tailproof)")
    if geometry is not None and geometry not in GEOMETRIES:
        raise CaptureError(f"--geometry: unknown geometry {geometry!r} "
                           f"(known: {', '.join(GEOMETRIES)})")


def capture(workload: str, path: str | Path, *, seed: int = 0, connector: str = "none",
            geometry: str | None = None, redact: bool = False,
            max_bytes: int | None = None) -> CaptureResult:
    """Run ``workload`` on a fresh CPU engine with the recorder attached; write ``path``."""
    check_arguments(workload, connector, geometry)
    w = WORKLOADS[workload]
    groups, h = GEOMETRIES[geometry] if geometry else (DEFAULT_GROUPS, 4)
    workers = (w.num_workers or 1) if connector != "none" else None
    engine = CaptureEngine(groups=groups, h=h, seed=seed, num_workers=workers,
                           connector=connector, **w.engine)
    release = installed_release()
    name = (f"cap_{workload}" + (f"_{geometry}" if geometry else "")
            + ("_mooncake" if connector == "mooncake" else "") + (f"_s{seed}" if seed else ""))
    desc = (f"Captured by `tailproof capture --workload {workload} --seed {seed}"
            + (f" --geometry {geometry}" if geometry else "")
            + (f" --connector {connector}" if workers else "") + f"` from vLLM {release}'s "
            "real Scheduler on CPU" + (" with " + _CONNECTOR_DESC[connector].format(
                n=workers, release=release) if workers else "")
            + f". {' '.join(w.description.split())}")
    plan = None
    if workers and w.store_plan is not None:
        store_plan = w.store_plan
        def plan(rank: int) -> Callable[[], str]:
            return store_plan(seed, rank)
    try:
        rec = Recorder.attach(engine.sched, path, redact=redact, max_bytes=max_bytes, name=name,
                              description=desc,
                              workers=engine.ranks.connectors if workers else None,
                              store_plan=plan)
    except BaseException:
        engine.shutdown()
        raise
    rec.enable_pool_states()
    try:
        w.run(engine, random.Random(seed))
        rec.pool_state()
    finally:
        rec.close()
        engine.shutdown()
    return CaptureResult(Path(path), rec.writer.num_ops, engine.steps, dict(rec.unmodelled))
