"""Attention blocks a partial tail publishes (mirrors ``_partial_tail_non_mamba_puts``, MS:62-132).

A later request resumes at the prompt's Mamba checkpoint ``ck(P)`` only if every group has
KV up to it: Mamba through its own exact hand-off, attention groups through the blocks from the
last lcm-aligned normal save up to ``ck(P)`` plus the group's EAGLE proof margin. The rule is
``spec.arithmetic.partial_tail_puts`` (shared with ``impl.scheduler_side``, so the model and
the proofs use the very same arithmetic); this module applies it to a ``StoreJob``.
"""

from __future__ import annotations

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.meta import BoundaryPut, StoreJob
from tailproof.spec import arithmetic
from tailproof.spec.arithmetic import NULL_BLOCK_ID

__all__ = ["NULL_BLOCK_ID", "partial_tail_puts"]


def partial_tail_puts(geo: StoreGeometry, job: StoreJob) -> list[BoundaryPut]:
    """Non-Mamba tail puts of ``job``: due when it publishes the prompt tail or carries the
    Mamba sub-block tail at ``ck(P)``; groups whose proof is not computed yet are omitted."""
    mamba_tails = [p.num_tokens for p in job.boundary_puts
                   if p.group_id in geo.mamba_group_ids
                   and p.num_tokens % geo.block_sizes[p.group_id]]
    if not mamba_tails and not job.publish_partial_tail:
        return []
    assert job.num_prompt_tokens is not None and job.completed_token_len is not None
    groups = range(len(geo.block_sizes))
    puts = arithmetic.partial_tail_puts(
        num_prompt_tokens=job.num_prompt_tokens, completed_token_len=job.completed_token_len,
        num_hashes=len(job.block_hashes), publish_partial_tail=job.publish_partial_tail,
        mamba_tail_boundaries=mamba_tails, block_ids=job.block_ids, block_sizes=geo.block_sizes,
        is_mamba=tuple(g in geo.mamba_group_ids for g in groups),
        eagle_margins=tuple(geo.eagle_proof_margin_by_group.get(g, 0) for g in groups),
        hash_block_size=geo.hash_block_size, scheduler_block_size=geo.scheduler_block_size,
        use_eagle=geo.use_eagle)
    return [BoundaryPut(*p) for p in puts]
