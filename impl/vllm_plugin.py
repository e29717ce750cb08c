"""vLLM plugin (entry point ``vllm.general_plugins``: ``tailproof_junctions``): the scheduler
hook the junction-checkpoint extension needs (docs/junctions.md, "The hook").

Contract ``tailproof-scheduler-hook/1``, for vLLM 0.33: after every
``vllm.v1.core.sched.scheduler.Scheduler.__init__`` in the process, the plugin calls
``scheduler.connector.on_scheduler_built(scheduler)`` when the scheduler has a connector that
defines it. ``TailproofConnector`` uses it only when ``junction_checkpoints`` is on, to set
``Scheduler.mamba_shared_prefix_checkpoint`` (the exact junction stop of
``Scheduler._mamba_block_aligned_split``, which vLLM 0.33 enables only with an EAGLE Mamba
group). Nothing else of vLLM changes; with no connector, or a connector without the method, or
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


def register() -> None:
    """The ``vllm.general_plugins`` entry point (may run several times per process)."""
    from tailproof.impl.import_hook import patch_on_import

    patch_on_import(_MODULE, _patch_module)
