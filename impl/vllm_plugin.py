"""vLLM plugin (entry point ``vllm.general_plugins``: ``tailproof_junctions``): the scheduler
hook the junction-checkpoint extension needs (docs/junctions.md, "The hook").

Contract ``tailproof-scheduler-hook/1``, for vLLM 0.33: after every
``vllm.v1.core.sched.scheduler.Scheduler.__init__`` in the process, the plugin calls
``scheduler.connector.on_scheduler_built(scheduler)`` when the scheduler has a connector that
defines it. ``TailproofConnector`` uses it only when ``junction_checkpoints`` is on, to set
``Scheduler.mamba_shared_prefix_checkpoint`` (the exact junction stop of
``Scheduler._mamba_block_aligned_split``, which vLLM 0.33 enables only with an EAGLE Mamba
group). It also lets the connector drain its store jobs before ``EngineCore._reset_caches``
(``patch_engine_core_class``: a paused engine's reset would fail on their pins). Nothing else
of vLLM changes; with no connector, or a connector without the method, or
the setting off, the plugin changes nothing. The connector refuses the hook on any vLLM other
than 0.33 (the attribute names are that version's).
"""

from __future__ import annotations

from typing import Any

HOOK_VERSION = "tailproof-scheduler-hook/1"
_MODULE = "vllm.v1.core.sched.scheduler"
_PATCHED = "_tailproof_scheduler_hook"


def patch_scheduler_class(cls: Any) -> None:
    """Call the connector's ``on_scheduler_built`` after every ``cls.__init__`` (idempotent)."""
    if getattr(cls, _PATCHED, False):
        return
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        hook = getattr(getattr(self, "connector", None), "on_scheduler_built", None)
        if callable(hook):
            hook(self)

    cls.__init__ = __init__
    setattr(cls, _PATCHED, True)


def _patch_module(module: Any) -> None:
    patch_scheduler_class(module.Scheduler)


_ENGINE_MODULE = "vllm.v1.engine.core"
_PATCHED_RESET = "_tailproof_reset_drain"


def patch_engine_core_class(cls: Any) -> None:
    """Before every ``cls._reset_caches`` (``pause_scheduler(clear_cache=True)``, sleep, weight
    updates) let the connector drain its store jobs (``drain_for_reset``): a paused scheduler
    runs no step, so their pins would otherwise make the reset fail and vLLM 0.33 raise
    (idempotent; a connector without the method changes nothing)."""
    if getattr(cls, _PATCHED_RESET, False) or not hasattr(cls, "_reset_caches"):
        return
    reset = cls._reset_caches

    def _reset_caches(self: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(getattr(self, "scheduler", None), "connector", None)
        drain = getattr(connector, "drain_for_reset", None)
        if callable(drain):
            drain(self.model_executor.collective_rpc)
        return reset(self, *args, **kwargs)

    cls._reset_caches = _reset_caches
    setattr(cls, _PATCHED_RESET, True)


def _patch_engine_module(module: Any) -> None:
    patch_engine_core_class(module.EngineCore)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (may run several times per process)."""
    from tailproof.impl.import_hook import patch_on_import

    patch_on_import(_MODULE, _patch_module)
    patch_on_import(_ENGINE_MODULE, _patch_engine_module)
