"""Chained prefix hashes at granularity h.

Mirrors ``kv_cache_utils.get_request_block_hasher`` / ``hash_block_tokens``: hash k covers tokens
``[0, (k+1)*h)`` by chaining ``H_k = sha256(H_{k-1} or NONE_HASH, tokens[k*h:(k+1)*h])``. The
bytes differ from vLLM's (different encoding), but the structure is the same: a hash identifies
a prefix, and only full h-units are hashed.

A prefix-cache key is ``(group_id, boundary_tokens, digest)``: vLLM's ``BlockHashWithGroupId`` is
``digest + group_id``; the boundary is implied by the digest and carried only so that
observations can name a key as ``(group, boundary)``.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes
Key = tuple[int, int, BlockHash]  # (group_id, boundary_tokens, digest)

NONE_HASH: BlockHash = hashlib.sha256(b"tailproof-none-hash").digest()


def hash_block_tokens(parent: BlockHash | None, tokens: list[int]) -> BlockHash:
    """sha256 over a canonical encoding of (parent, tokens) (``hash_block_tokens``)."""
    payload = (parent or NONE_HASH) + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.sha256(payload).digest()


def extend_block_hashes(hashes: list[BlockHash], tokens: list[int], h: int) -> None:
    """Append the hashes of every new full h-unit of ``tokens`` (``request_block_hasher``)."""
    start = len(hashes) * h
    parent = hashes[-1] if hashes else None
    while start + h <= len(tokens):
        parent = hash_block_tokens(parent, tokens[start : start + h])
        hashes.append(parent)
        start += h


def make_key(group_id: int, boundary: int, hashes: list[BlockHash], h: int) -> Key:
    """The key of a prefix of ``boundary`` tokens in ``group_id`` (``make_block_hash_with_group_id``
    of ``block_hashes[boundary // h - 1]``, as ``resolve_block_hashes`` views it)."""
    return (group_id, boundary, hashes[boundary // h - 1])
