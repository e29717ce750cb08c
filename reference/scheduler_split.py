"""Where a prefill chunk must end so Mamba states land on cacheable positions (mirrors
``Scheduler._mamba_block_aligned_split`` in ``v1/core/sched/scheduler.py``).

Scope: no internal prefill checkpoints, no hash lookahead. The shared-prefix junction
(``Request.shared_prefix_boundary``, set by the admission lookup) is a stop: block-floored from
the chunk start, or the junction itself when ``Scheduler.mamba_shared_prefix_checkpoint`` holds
and the junction lies within the prompt.
"""

from __future__ import annotations

from tailproof.reference.geometry import Geometry
from tailproof.reference.request import Request
from tailproof.spec.arithmetic import checkpoint_position


def mamba_block_aligned_split(
    geo: Geometry,
    request: Request,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """Clip a prefill chunk: block-aligned ends, never past the last cacheable block boundary,
    a stop at the prompt's partial-tail boundary ck(P), and a stop at the shared-prefix
    junction when the chunk crosses it."""
    start = (
        request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    )
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    block_size = geo.cache_config_block_size
    drop = geo.use_eagle
    last_cache_position = checkpoint_position(request.num_tokens, block_size, drop)
    end = start + num_new_tokens
    if end < prefill_end:
        max_prefill_tokens = geo.max_num_scheduled_tokens
        if geo.long_prefill_token_threshold > 0:
            max_prefill_tokens = min(max_prefill_tokens, geo.long_prefill_token_threshold)
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill_tokens:
            end = aligned_end
    next_block_boundary = (start // block_size + 1) * block_size
    tail_boundary = (
        checkpoint_position(request.num_prompt_tokens, geo.hash_block_size, drop)
        if geo.mamba_partial_cache_hit
        else 0
    )
    junction = request.shared_prefix_boundary
    # Block-floored from the chunk start: a sub-block junction's state is kept only when the
    # manager keys it (the flag, EAGLE, partial hits) and the junction is inside the prompt.
    block_floored = start + (junction - start) // block_size * block_size
    junction_stop = (
        junction
        if geo.mamba_shared_prefix_checkpoint and junction <= request.num_prompt_tokens
        else block_floored
    )
    stops = (
        next_block_boundary if start % block_size != 0 else 0,
        last_cache_position,
        tail_boundary if last_cache_position < tail_boundary < request.num_prompt_tokens else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def plan_chunk(
    geo: Geometry,
    request: Request,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """The scheduler splits only when a Mamba align group exists
    (``Scheduler.need_mamba_block_aligned_split``)."""
    if not geo.has_mamba:
        return num_new_tokens
    return mamba_block_aligned_split(
        geo, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
    )
