"""vLLM plugin (entry point ``vllm.general_plugins``): record a trace from any vLLM 0.33 engine
without changing its code.

vLLM loads general plugins in every process, the engine core included, before it builds the
scheduler. ``register`` arranges that every ``vllm.v1.core.sched.scheduler.Scheduler`` built
afterwards in this process gets a :class:`~tailproof.conformance.capture.recorder.Recorder`
when recording is asked for, by either

* the environment: ``TAILPROOF_RECORD=out.json`` (``TAILPROOF_RECORD_REDACT=1`` to redact
  token ids, ``TAILPROOF_RECORD_MAX_BYTES=N`` to rotate segments past N bytes), or
* ``--kv-transfer-config``: ``kv_connector_extra_config.tailproof_record`` = a path, or
  ``{"path": ..., "redact": bool, "max_bytes": int}``.

``{pid}`` in the path is replaced by the process id (several engine cores). The trace is
closed when the scheduler shuts down (and at interpreter exit otherwise). Without either
setting the plugin changes nothing. The scheduler's thread only queues each op's values;
a writer thread of the recorder builds, encodes and writes them.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

_MODULE = "vllm.v1.core.sched.scheduler"
_PATCHED = "_tailproof_recorder_patched"
ENV = "TAILPROOF_RECORD"
EXTRA_KEY = "tailproof_record"


def settings(vllm_config: Any) -> dict[str, Any] | None:
    """What to record for this engine: {path, redact, max_bytes}, or None."""
    doc: Any = None
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is not None and ktc.kv_connector_extra_config:
        doc = ktc.kv_connector_extra_config.get(EXTRA_KEY)
    if doc is None and os.environ.get(ENV):
        doc = {"path": os.environ[ENV],
               "redact": os.environ.get("TAILPROOF_RECORD_REDACT", "") not in ("", "0"),
               "max_bytes": int(os.environ["TAILPROOF_RECORD_MAX_BYTES"])
               if os.environ.get("TAILPROOF_RECORD_MAX_BYTES") else None}
    if doc is None:
        return None
    if isinstance(doc, str):
        doc = {"path": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("path"), str) or not doc["path"]:
        raise ValueError(f"{EXTRA_KEY}: expected a path or {{\"path\": ...}}, got {doc!r}")
    unknown = sorted(set(doc) - {"path", "redact", "max_bytes"})
    if unknown:
        raise ValueError(f"{EXTRA_KEY}.{unknown[0]}: unknown key")
    return {"path": doc["path"].replace("{pid}", str(os.getpid())),
            "redact": bool(doc.get("redact", False)), "max_bytes": doc.get("max_bytes")}


def in_process_workers(scheduler: Any) -> list[Any] | None:
    """The engine's worker connector when it lives in this process beside ``scheduler``'s
    (``TailproofConnector``, one worker, vLLM's ``uni`` executor with the engine core in this
    process: the worker connector is vLLM's process-global KV transfer group, built by the
    worker before the scheduler), so the trace records the connector's ops and its pins; None
    otherwise (the trace then records the core only, docs/triage.md)."""
    from tailproof.impl.connector import TailproofConnector

    if not isinstance(getattr(scheduler, "connector", None), TailproofConnector):
        return None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    wc = get_kv_transfer_group()
    side = getattr(wc, "worker_side", None)
    if wc is scheduler.connector or side is None:
        return None
    if side.settings.send_threads != 1:  # no FIFO order of jobs to record
        logger.warning("tailproof: send_threads=%d: recording the core only (connector ops "
                       "need send_threads=1)", side.settings.send_threads)
        return None
    return [wc]


def _close(recorder: Any) -> None:
    """Close a recorder; a trace that could not be written is logged, never raised into
    the engine's shutdown."""
    try:
        recorder.close()
    except Exception as e:  # noqa: BLE001 - the engine must shut down whatever the disk did
        logger.error("tailproof: the trace could not be written completely: %s", e)


def patch_scheduler_class(cls: Any) -> None:
    """Make every ``cls`` instance record when asked to (idempotent)."""
    if getattr(cls, _PATCHED, False):
        return
    init, shutdown = cls.__init__, cls.shutdown

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        s = settings(self.vllm_config)
        if s is None:
            return
        # deferred: the plugin loads in every vLLM process; only engines that record pay
        from tailproof.conformance.capture.recorder import Recorder

        self._tailproof_recorder = Recorder.attach(
            self, s["path"], redact=s["redact"], max_bytes=s["max_bytes"],
            workers=in_process_workers(self))
        atexit.register(_close, self._tailproof_recorder)
        logger.warning("tailproof: recording KV cache manager calls to %s", s["path"])

    def shutdown_and_close(self: Any) -> None:
        try:
            shutdown(self)
        finally:
            rec = getattr(self, "_tailproof_recorder", None)
            if rec is not None:
                _close(rec)

    cls.__init__ = __init__
    cls.shutdown = shutdown_and_close
    setattr(cls, _PATCHED, True)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (may run several times per process)."""
    from tailproof.impl.import_hook import patch_on_import

    patch_on_import(_MODULE, _patch_module)


def _patch_module(module: Any) -> None:
    patch_scheduler_class(module.Scheduler)
