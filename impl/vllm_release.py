"""Where the vLLM releases the connector supports (0.33, 0.34) hand it different shapes or
store differently: one named switch per difference, read once from vLLM's own classes (never
from a version string), each citing the vLLM function behind it in both releases
(docs/releases.md lists them next to the reference's).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from functools import cache

#: The ``CachedRequestData`` field listing the step's resumed cached rows: present on 0.33,
#: gone on 0.34 (:func:`resumed_as_cached`), so ``getattr(cached, RESUMED_ROWS, ())`` reads
#: them on either release (a name, not a function: the scheduler side reads it every step).
RESUMED_ROWS = "resumed_req_ids"


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

    return any(f.name == RESUMED_ROWS for f in dataclasses.fields(CachedRequestData))


_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"


@cache
def preempted_tracker_dropped() -> bool:
    """Whether a preempted request's tracker is dropped rather than reset.

    vLLM 0.33 (``MooncakeStoreScheduler.build_connector_meta``, ``mooncake/store/scheduler.py``):
    ``request_tracker.reset()`` keeps a zeroed tracker until the request is scheduled again.
    vLLM 0.34 (same function): ``self._request_trackers.pop(req_id, None)``, and
    ``RequestTracker.reset`` (``mooncake/store/data.py``) is gone.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # deferred
        RequestTracker,
    )

    return not hasattr(RequestTracker, "reset")


@cache
def monotone_saved_offset() -> bool:
    """Whether a rank's saved offset only moves forward, after a fully successful save.

    vLLM 0.33 (``KVCacheStoreSendingThread._handle_request`` / ``_record_saved``,
    ``mooncake/store/worker.py``): any save that did not fail sets the offset to the job's
    length, source blocks that are unavailable skipped. vLLM 0.34 (``_handle_request`` /
    ``_record_saved_offset``): ``max(offset, length)``, recorded only when no put failed and no
    source block was missing (else the next job retries the range); a job at or below the
    offset returns at once. The rule came with the rename, which is what is read here.
    """
    worker = importlib.import_module(f"{_MOONCAKE}.worker")  # deferred: vLLM is heavy
    return hasattr(worker.KVCacheStoreSendingThread, "_record_saved_offset")


@cache
def decode_checkpoints() -> bool:
    """Whether ``save_decode_cache`` stores the Mamba states of decode-time block boundaries.

    vLLM 0.33 (``MooncakeStoreScheduler._handle_boundary_state_offloads``, called for
    producers only): every boundary past ``prefill_end_tokens`` is dropped (vllm#56972).
    vLLM 0.34 (same function, called when ``not is_consumer or save_decode_cache``): with
    ``save_decode_cache`` they are stored, and a consumer stores those only. No name changed
    with it, so the function's own source is read for the flag it now consults.
    """
    sched = importlib.import_module(f"{_MOONCAKE}.scheduler")  # deferred: vLLM is heavy
    src = inspect.getsource(sched.MooncakeStoreScheduler._handle_boundary_state_offloads)
    return "self.save_decode_cache" in src


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
