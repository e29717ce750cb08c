"""The vLLM releases the reference follows (0.33, 0.34): one switch per behaviour that differs,
each citing the function behind it in both releases (docs/releases.md lists them).

A trace names its release (``config.vllm``; none reads as 0.33). The model reads only these
switches, never the release name, so each difference is one ``if`` where the rule lives.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT = "0.33"


@dataclass(frozen=True)
class Release:
    """What one vLLM release does where the supported releases differ."""

    name: str
    # 0.33 ``v1/core/sched/scheduler.py`` ``Scheduler._make_cached_request_data`` (Model Runner
    # V1): a resumed request is a cached row, after the running ones, handled in the resumed
    # branch of ``mooncake/store/scheduler.py`` ``MooncakeStoreScheduler.build_connector_meta``.
    # 0.34 ``Scheduler.schedule`` (same module: "A resumed request is re-sent in full, like a
    # new one"): a ``NewRequestData``, in admission order, handled before the running requests
    # with ``prefill_end_tokens = len(prefill_token_ids)`` (``build_connector_meta``).
    resumed_as_new: bool
    # 0.33 ``mooncake/store/scheduler.py`` ``MooncakeStoreScheduler.build_connector_meta``: a
    # preempted request's tracker is ``RequestTracker.reset()`` and kept. 0.34 (same module and
    # function): it is popped (``RequestTracker.reset`` is gone from ``mooncake/store/data.py``).
    preempted_tracker_dropped: bool
    # 0.33 ``mooncake/store/worker.py`` ``KVCacheStoreSendingThread._handle_request`` /
    # ``_record_saved``: the offset becomes the job's length after any save that did not fail,
    # unavailable source blocks skipped. 0.34 (same module, ``_handle_request`` /
    # ``_record_saved_offset``): ``max(offset, length)``, recorded (and the pressure gate
    # cleared) only when nothing failed and no source block was missing; a job at or below the
    # offset returns at once.
    monotone_saved_offset: bool
    # 0.33 ``mooncake/store/scheduler.py`` ``MooncakeStoreScheduler.
    # _handle_boundary_state_offloads`` (``build_connector_meta`` calls it for producers only):
    # boundaries past ``prefill_end_tokens`` are dropped (vllm#56972). 0.34 (same module and
    # functions, called when ``not is_consumer or save_decode_cache``): with
    # ``save_decode_cache`` they are stored; a consumer stores decode boundaries only.
    decode_checkpoints: bool
    # 0.33 ``v1/core/kv_cache_manager.py`` ``KVCacheManager.get_computed_blocks``: an explicit
    # bound is used as given (None: ``num_tokens - 1``). 0.34 (same function, through
    # ``v1/request.py`` ``Request.get_max_cache_hit_length``): it is clamped to
    # ``num_tokens - 1``, so the last token is always recomputed.
    clamp_lookup_bound: bool


RELEASES: dict[str, Release] = {
    "0.33": Release("0.33", resumed_as_new=False, preempted_tracker_dropped=False,
                    monotone_saved_offset=False, decode_checkpoints=False,
                    clamp_lookup_bound=False),
    "0.34": Release("0.34", resumed_as_new=True, preempted_tracker_dropped=True,
                    monotone_saved_offset=True, decode_checkpoints=True,
                    clamp_lookup_bound=True),
}


def release(name: str | None) -> Release:
    """The switches of release ``name`` (None: the default, 0.33)."""
    return RELEASES[name or DEFAULT]
