"""Write token lists in the compact trace notation (``conformance/format/tokens.py`` reads it back).

A prompt that repeats the start of an earlier prompt becomes ``{"prompt_of": A, "n": k}``;
the rest is run-length coded: runs of one value as ``{"fill": v, "n": k}``, runs of
consecutive ids as ``{"range": [a, b]}``. Shared prefixes are found through the requests'
block hashes (equal hash at block k = equal first (k+1)*h tokens), so finding one costs a
dict lookup per block, not a token comparison against every earlier prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MIN_RUN = 4  # shorter runs are cheaper written as plain ints


def run_length(tokens: list[int]) -> list[Any]:
    """``tokens`` as ints, fills and ranges (expands back to exactly ``tokens``)."""
    out: list[Any] = []
    i, n = 0, len(tokens)
    while i < n:
        v = tokens[i]
        j = i + 1
        while j < n and tokens[j] == v:
            j += 1
        if j - i >= MIN_RUN:
            out.append({"fill": v, "n": j - i})
            i = j
            continue
        j = i + 1
        while j < n and tokens[j] == tokens[j - 1] + 1:
            j += 1
        if j - i >= MIN_RUN:
            out.append({"range": [v, tokens[j - 1] + 1]})
            i = j
            continue
        out.append(v)
        i += 1
    return out


class PrefixIndex:
    """Recent prompts by the hashes of their blocks, to write shared prefixes as ``prompt_of``.

    Bounded: at most ``max_entries`` block hashes are remembered (oldest forgotten first), so
    memory does not grow with the length of a capture; a forgotten prefix is simply written
    out in full.
    """

    def __init__(self, hash_block_size: int, max_entries: int = 200_000) -> None:
        self.h = hash_block_size
        self.max_entries = max_entries
        self._by_hash: OrderedDict[bytes, str] = OrderedDict()
        self._prompts: dict[str, list[int]] = {}  # the trace's current prompt of each rid
        self._refs: dict[str, int] = {}  # index entries pointing at each rid

    def encode(self, rid: str, tokens: list[int], block_hashes: list[bytes],
               runs: bool = True) -> list[Any]:
        """Compact form of ``rid``'s prompt ``tokens`` (``block_hashes`` at h granularity,
        computed on the original tokens) and remember it for later prompts; ``runs=False``
        leaves the unshared rest as plain ints (no per-token pass)."""
        src, n = self._longest_shared(tokens, block_hashes)
        out: list[Any] = [{"prompt_of": src, "n": n}] if src is not None and n else []
        out += run_length(tokens[n:]) if runs else tokens[n:]
        # Index after matching: a reused rid replaces its old prompt (as the loader does).
        if rid in self._prompts:  # a reused id: its old prompt is gone from the trace
            for k in [k for k, r in self._by_hash.items() if r == rid]:
                self._drop(k)
        self._prompts[rid] = tokens
        by_hash = self._by_hash
        added = 0
        # Only blocks not indexed yet: a shared prefix keeps pointing at its first holder.
        for bh in block_hashes[: len(tokens) // self.h]:
            key = bh if type(bh) is bytes else bytes(bh)
            if key not in by_hash:
                by_hash[key] = rid
                added += 1
        if added:
            self._refs[rid] = self._refs.get(rid, 0) + added
        while len(self._by_hash) > self.max_entries:
            self._drop(next(iter(self._by_hash)))
        return out

    def _drop(self, key: bytes) -> None:
        rid = self._by_hash.pop(key)
        self._refs[rid] -= 1
        if not self._refs[rid]:
            del self._refs[rid]
            self._prompts.pop(rid, None)

    def _longest_shared(self, tokens: list[int],
                        block_hashes: list[bytes]) -> tuple[str | None, int]:
        for k in range(min(len(block_hashes), len(tokens) // self.h) - 1, -1, -1):
            src = self._by_hash.get(bytes(block_hashes[k]))
            if src is None:
                continue
            other = self._prompts[src]
            n = (k + 1) * self.h
            while n < len(tokens) and n < len(other) and tokens[n] == other[n]:
                n += 1
            return src, n
        return None, 0
