"""Attention blocks a partial tail publishes (mirrors ``_partial_tail_non_mamba_puts``, MS:62-132).

A later request resumes at the prompt's Mamba checkpoint ``ck(P)`` only if every group has
KV up to it: Mamba through its own exact hand-off, attention groups through the blocks from the
last lcm-aligned normal save up to ``ck(P)`` plus the group's EAGLE proof margin. The boundary
arithmetic comes from ``spec/arithmetic.py`` so the model and the proofs share it.
"""

from __future__ import annotations

from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.meta import BoundaryPut, ReqMeta
from tailproof.spec.arithmetic import checkpoint_position, tail_put_range

NULL_BLOCK_ID = 0


def partial_tail_puts(geo: StoreGeometry, job: ReqMeta) -> list[BoundaryPut]:
    """Non-Mamba tail puts of ``job``: due when it publishes the prompt tail or carries the
    Mamba sub-block tail at ``ck(P)``; groups whose proof is not computed yet are omitted."""
    mamba_tails = [p.num_tokens for p in job.boundary_puts
                   if p.group_id in geo.mamba_group_ids
                   and p.num_tokens % geo.block_sizes[p.group_id]]
    if not mamba_tails and not job.publish_partial_tail:
        return []
    assert job.num_prompt_tokens is not None and job.completed_token_len is not None
    h = geo.hash_block_size
    # The core drops the checkpoint whenever EAGLE block drop is on (MS:102-106).
    boundary = checkpoint_position(job.num_prompt_tokens, h, geo.use_eagle)
    # Any other sub-block hand-off is a shared-prefix junction: no attention tail (MS:110).
    if not job.publish_partial_tail and boundary not in mamba_tails:
        return []
    num_hashes = len(job.block_hashes)
    if boundary == 0 or boundary // h > num_hashes:
        return []
    puts: list[BoundaryPut] = []
    for gid, bs in enumerate(geo.block_sizes):
        if gid in geo.mamba_group_ids:
            continue
        margin = geo.eagle_proof_margin_by_group.get(gid, 0)
        proof_end = boundary + margin
        if proof_end > job.completed_token_len or proof_end // h > num_hashes:
            continue
        first, end = tail_put_range(boundary, geo.lcm_block_size, bs, margin)
        table = job.block_ids[gid]
        for idx in range(first, end):
            if idx >= len(table):
                break
            if table[idx] == NULL_BLOCK_ID:
                continue
            puts.append(BoundaryPut(gid, table[idx], min((idx + 1) * bs, proof_end)))
    return puts
