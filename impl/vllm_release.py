"""Where the vLLM releases the connector supports (0.33, 0.34) hand it different shapes: one
named switch per difference, read once from vLLM's own classes (never from a version string),
each citing the vLLM function behind it in both releases.
"""

from __future__ import annotations

import dataclasses
from functools import cache


@cache
def resumed_as_cached() -> bool:
    """Whether a resumed request can arrive among the *cached* requests of a step.

    vLLM 0.33 (``Scheduler._make_cached_request_data``, ``v1/core/sched/scheduler.py``): under
    Model Runner V1 a resumed request is a cached row listed in
    ``CachedRequestData.resumed_req_ids``, with its whole table in ``new_block_ids``.
    vLLM 0.34 (``Scheduler.schedule``: "A resumed request is re-sent in full, like a new one"):
    the field is gone and every resumed request is a ``NewRequestData`` whose
    ``prefill_token_ids`` are the prompt plus the outputs (as 0.33's Model Runner V2 did).
    """
    from vllm.v1.core.sched.output import CachedRequestData  # deferred: vLLM is heavy

    return any(f.name == "resumed_req_ids" for f in dataclasses.fields(CachedRequestData))


def resumed_ids(cached: object) -> frozenset[str] | set[str]:
    """The step's resumed cached rows: ``CachedRequestData.resumed_req_ids`` on 0.33, always
    empty on 0.34 (:func:`resumed_as_cached`)."""
    return getattr(cached, "resumed_req_ids", frozenset())


#: Releases whose scheduler names the junction hook sets were checked against: 0.33, and 0.34,
#: where ``Scheduler.mamba_shared_prefix_checkpoint``, ``mamba_partial_cache_hit``,
#: ``KVCacheManager.mamba_shared_prefix_checkpoint``, ``MambaManager.shared_prefix_checkpoint``
#: and ``coordinator.num_reprefillable_tokens`` are unchanged (``kv_cache_coordinator.py`` is
#: byte-identical between the two).
JUNCTION_HOOK_RELEASES = ("0.33", "0.34")


def junction_hook_supported(version: str) -> bool:
    """Whether ``TailproofConnector.on_scheduler_built`` may set the junction stop on this
    vLLM version string."""
    return any(version == r or version.startswith(r + ".") for r in JUNCTION_HOOK_RELEASES)
