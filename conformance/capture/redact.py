"""Redaction: replace token ids by canonical ids that keep only what prefix hashing sees.

vLLM hashes a request in blocks of h tokens, each block's hash chained to its parent's
(``kv_cache_utils.hash_block_tokens``): two blocks hash equal exactly when their parents are
equal and their tokens are equal. A token is therefore renamed by its *context*: the pair
(parent block hash, offset in the block, token id) gets a fresh id the first time it is seen.
Equal prefixes stay equal (so every hit, block and hash count of the trace is unchanged) and
different prefixes stay different (by induction over the chain), but the same token in two
different contexts gets two unrelated ids: vocabulary, word frequencies and text do not
survive, only the sharing structure does. The renaming is streaming (a block's parent is
known before its first token arrives) and deterministic for a given capture.
"""

from __future__ import annotations

_ROOT = b""


class Redactor:
    """Canonical ids in order of first appearance; one instance per trace."""

    def __init__(self, hash_block_size: int) -> None:
        self.h = hash_block_size
        self._ids: dict[tuple[bytes, int, int], int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def tokens(self, tokens: list[int], start: int, block_hashes: list[bytes],
               root: bytes = _ROOT) -> list[int]:
        """Canonical ids of ``tokens``, which sit at positions ``start``.. of a request whose
        (original) block hashes are ``block_hashes``; ``root`` stands for what else feeds the
        first block's hash (a ``cache_salt``)."""
        out = []
        ids = self._ids
        h = self.h
        for i, t in enumerate(tokens):
            pos = start + i
            k = pos // h
            parent = bytes(block_hashes[k - 1]) if k else root
            key = (parent, pos % h, t)
            c = ids.get(key)
            if c is None:
                c = ids[key] = len(ids)
            out.append(c)
        return out
