"""Findings that only vLLM's own ``Scheduler`` shows: detectors that run it on CPU through the
capture engine (``conformance/tools/capture_engine``, vLLM's ``MooncakeStoreConnector`` on an
embedded store), a few seconds each. ``tailproof history`` runs them; ``check`` does not.

The forced-preemption hang (docs/triage.md): ``Scheduler.reset_prefix_cache(
reset_running_requests=True)`` preempts a decoding request outside ``schedule()``; the next
``schedule()`` re-admits it and reports it preempted in the same ``SchedulerOutput``, and
``MooncakeStoreScheduler.build_connector_meta`` drops the preempted request's state before it
handles the admission. Each release's variants are played: the asynchronous load (a hang) and
the synchronous one under every model runner the release schedules for (a crash, or a hang).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from tailproof.conformance.vllm_release import default_model_runner

Witness = tuple[int, str]

#: Steps a re-admitted request gets to leave WAITING_FOR_REMOTE_KVS (its load lands in the
#: step that issues it: one would do).
STALL_STEPS = 30
#: A prompt of 3 blocks and a bit (FA 16, Mamba 16, h 4): its blocks are saved while it decodes.
PROMPT = [9] * 40 + [3] * 20


def _vllm_frame(exc: BaseException) -> str:
    """The innermost vLLM function the exception passed through (``Class.method``)."""
    names = [tb.tb_frame.f_code.co_qualname for tb in _frames(exc.__traceback__)
             if "/vllm/" in tb.tb_frame.f_code.co_filename]
    return names[-1] if names else "?"


def _frames(tb: TracebackType | None) -> list[TracebackType]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def readmission_after_forced_preemption(load_async: bool, v2_runner: bool | None) -> str | None:
    """Run one request that decodes with its blocks saved, force its preemption, and step
    until it is served again; None when it is, else what happened instead."""
    from tailproof.conformance.tools.capture_engine.engine import (  # deferred: vLLM
        CaptureEngine,
        mooncake_connector_config,
    )

    kv: dict[str, Any] = mooncake_connector_config()
    kv["kv_connector_extra_config"]["load_async"] = load_async
    e = CaptureEngine(num_workers=1, connector="mooncake", kv_transfer=kv)
    try:
        if v2_runner is not None:
            e.sched.use_v2_model_runner = v2_runner
        req = e.add("a", PROMPT, max_tokens=12)
        for _ in range(4):  # prefill and decode: its blocks are saved to the store
            e.step()
        if not e.sched.reset_prefix_cache(reset_running_requests=True):
            return "reset_prefix_cache(reset_running_requests=True) refused"
        try:
            for _ in range(STALL_STEPS):
                e.step()
                if not e.sched.has_requests():
                    return None
        except Exception as exc:  # noqa: BLE001 - the crash is the finding
            return f"{type(exc).__name__} in {_vllm_frame(exc)}"
        return (f"{req.status.name} after {STALL_STEPS} steps"
                if req.status.name == "WAITING_FOR_REMOTE_KVS" else None)
    finally:
        e.shutdown()


def _runners() -> list[tuple[str, bool | None]]:
    """The model runners the installed ``Scheduler`` schedules for: 0.33 both (its
    ``use_v2_model_runner`` picks the shape of a resumed request), 0.34 only V2 (the switch
    is gone: a resumed request is a new one)."""
    if default_model_runner() == "v1":
        return [("Model Runner V1", False), ("Model Runner V2", True)]
    return [("Model Runner V2", None)]


def forced_preemption_stalls() -> list[Witness]:
    """One witness per variant in which the re-admitted request is not served."""
    out: list[Witness] = []
    stalled = readmission_after_forced_preemption(True, None)
    if stalled:
        out.append((-1, f"asynchronous load: {stalled} (no load issued)"))
    for name, v2 in _runners():
        stalled = readmission_after_forced_preemption(False, v2)
        if stalled:
            out.append((-1, f"synchronous load, {name}: {stalled}"))
    return out
