"""Hash-aligned store lookup: how many prefix tokens of a request the store can supply.

Semantics: ``tailproof.reference.connector.lookup.store_lookup``. Mirrors vLLM 0.33's
``MooncakeStoreWorker.lookup`` and ``_tail_key_boundaries``.

Why this shape: a hybrid hit at n needs *every* group's KV at n (full-attention blocks up to n,
a Mamba state at exactly n) and, with EAGLE, proof past n. Rather than re-deriving that fixed
point, the lookup asks the store which (group, prefix-hash) keys exist -- on every worker rank's
shard -- and runs vLLM 0.33's own mirror of the core hit search
(``MooncakeStoreCoordinator.find_longest_cache_hit``) over that set, so the connector's hit can
never disagree with what the core would accept. A hit covering the whole request is re-derived
one alignment unit lower: the last token is always recomputed for its logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
    MooncakeStoreCoordinator,
)

from tailproof.impl.config import StoreGeometry
from tailproof.impl.keys import INITIAL_EPOCH, KeySpace
from tailproof.impl.meta import TailKeyBoundary
from tailproof.spec.arithmetic import cdiv

ExistsFn = Callable[[Sequence[str]], list[bool]]


@dataclass(frozen=True)
class LookupResult:
    """A store hit (``data.MooncakeLookupResult``): its length and, per store group, the
    boundary keying its last block."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


class StoreLookup:
    """Answers "longest loadable prefix" for a request's block hashes against a store."""

    def __init__(
        self, geo: StoreGeometry, coord: MooncakeStoreCoordinator, exists: ExistsFn,
        keys: KeySpace, world_size: int,
    ):
        self.geo = geo
        self.coord = coord
        self.exists = exists
        self.keys = keys
        self.world = world_size
        self.epoch = INITIAL_EPOCH  # moved by a prefix-cache reset (``keys.new_epoch``)

    def _candidates(self, hashes: Sequence[bytes], token_len: int) -> list[tuple[int, bytes]]:
        geo = self.geo
        out: list[tuple[int, bytes]] = []
        if geo.partial_hits:
            units = min(len(hashes), token_len // geo.hash_block_size)
            for g in range(geo.num_groups):
                out.extend((g, bytes(hashes[u])) for u in range(units))
            return out
        masks = self.coord.lookup_mask(token_len)
        for g, group in enumerate(self.coord.kv_cache_groups):
            ghashes = self.coord.block_hashes_for_spec(hashes, group.kv_cache_spec)
            limit = min(len(ghashes), cdiv(token_len, geo.block_sizes[g]))
            mask = masks[g] if masks is not None else None
            if mask is not None:
                limit = min(limit, len(mask))
            out.extend(
                (g, bytes(ghashes[i])) for i in range(limit) if mask is None or mask[i]
            )
        return out

    def present(self, hashes: Sequence[bytes], token_len: int) -> set[tuple[int, bytes]]:
        """(group, hash) pairs stored on every rank's shard (an error counts as absent)."""
        cands = self._candidates(hashes, token_len)
        if not cands:
            return set()
        keys = [
            self.keys.key(r, g, h, self.epoch)
            for g, h in cands
            for r in range(self.world)
        ]
        found = self.exists(keys)
        w = self.world
        return {c for i, c in enumerate(cands) if all(found[i * w : (i + 1) * w])}

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> LookupResult:
        """Longest aligned prefix of ``num_tokens`` tokens loadable from the store."""
        geo = self.geo
        token_len = geo.align_lookup_length(num_tokens)
        if not hashes or token_len <= 0:
            return LookupResult(0)
        present = self.present(hashes, token_len)
        if not present:
            return LookupResult(0)
        pool = ExternalCachedBlockPool(geo.hash_block_size, present)
        _, hit = self.coord.find_longest_cache_hit(hashes, token_len, pool)
        if hit >= num_tokens:
            usable = geo.align_lookup_length(num_tokens - 1)
            if usable <= 0:
                return LookupResult(0)
            _, hit = self.coord.find_longest_cache_hit(hashes, usable, pool)
        if hit <= 0:
            return LookupResult(0)
        return LookupResult(hit, self._tail_key_boundaries(hashes, hit, present))

    def _tail_key_boundaries(
        self, hashes: Sequence[bytes], hit: int, present: set[tuple[int, bytes]]
    ) -> tuple[TailKeyBoundary, ...]:
        """Per group: ``hit`` if its key exists, else the first later stored boundary inside
        the same block (fail closed: no such key means no hit)."""
        h = self.geo.hash_block_size
        out: list[TailKeyBoundary] = []
        for g, bs in enumerate(self.geo.block_sizes):
            if (g, bytes(hashes[hit // h - 1])) in present:
                out.append(TailKeyBoundary(g, hit))
                continue
            end = min(cdiv(hit, bs) * bs // h, len(hashes))
            for idx in range(hit // h, end):
                if (g, bytes(hashes[idx])) in present:
                    out.append(TailKeyBoundary(g, (idx + 1) * h))
                    break
            else:
                raise AssertionError(f"no tail key for store group {g} at hit {hit}")
        return tuple(out)
