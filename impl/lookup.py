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

Remembered lookups (``lookup(..., rid=...)``; docs/connector-ops.md, "Remembered lookups"; not
vLLM 0.33, whose ``lookup`` probes every candidate key on every ask): a waiting request is
asked about every step until it is admitted, so its answer is kept between steps. The keys
found present are remembered; the only ones asked again are those past the last hit, up to the
full-attention frontier (its first missing key, plus one lcm block): a hit is a prefix, so no
key beyond the frontier can change it while the frontier key is missing. Past the frontier the
keys are probed in doubling contiguous batches (every key of a batch, so a hole is never
skipped). A store that counts its removals (``Store.removal_count``: the memory store, the
trace adapters' stores) makes a removal a store event the connector sees: the memo is dropped
and rebuilt. A store that counts every change (``Store.change_count``: the memory store) and
reports none since the last ask is asked nothing: its ``exists`` answers are the ones the memo
holds, so the remembered answer is the fresh one. A store that cannot report its removals
(Mooncake evicts silently) may leave a remembered key gone: its load then fails closed (the
value is absent: ``read_batch`` fails, no block is written), is reported in ``failed_recving``
and recomputed, and the request is never offered the store again
(``SchedulerSide.load_failed``; counted as ``loads_failed`` / ``remembered_hits_failed``). An
eviction in the middle of a remembered prefix is the same case: the whole load fails (all or
nothing), never a partial or wrong value.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
    MooncakeStoreCoordinator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    chunk_hashes_for_block_size,
)

from tailproof.impl.config import StoreGeometry
from tailproof.impl.keys import KeyEpoch, KeySpace
from tailproof.impl.meta import TailKeyBoundary
from tailproof.spec.arithmetic import cdiv

ExistsFn = Callable[[Sequence[str]], list[bool]]
RemovalsFn = Callable[[], "int | None"]  # also the type of a store's change count

#: Remembered lookups kept at most (waiting requests; the oldest is dropped beyond it).
MEMO_LIMIT = 4096
#: Candidates in the first batch probed past the frontier (then doubling).
FIRST_BATCH = 8


@dataclass(frozen=True)
class LookupResult:
    """A store hit (``data.MooncakeLookupResult``): its length and, per store group, the
    boundary keying its last block."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


class _Listed:
    """Candidates listed up front, in (token end, group) order (partial hits off: one per
    looked-up block of each group)."""

    def __init__(self, cands: list[tuple[int, bytes, int]], fa: Sequence[bool],
                 block_sizes: Sequence[int]) -> None:
        cands = sorted(cands, key=lambda c: (c[2], c[0]))
        self.keys = [(g, hh) for g, hh, _ in cands]
        self.ends = [e for _, _, e in cands]
        self.fa = [fa[g] and e % block_sizes[g] == 0 for g, _, e in cands]

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> tuple[int, bytes]:
        return self.keys[i]

    def end(self, i: int) -> int:
        return self.ends[i]

    def is_fa(self, i: int) -> bool:
        return self.fa[i]

    def upto(self, tokens: int) -> int:
        """How many candidates end at or before ``tokens``."""
        return bisect_right(self.ends, tokens)


class _Units:
    """The partial-hit candidates (every group at every hash unit below the aligned length),
    made on demand so that a long prompt costs nothing until its keys are asked: candidate i
    is group ``i % G`` at unit ``i // G`` (the same order as :class:`_Listed`)."""

    def __init__(self, hashes: Sequence[bytes], units: int, h: int, fa: Sequence[bool],
                 block_sizes: Sequence[int]) -> None:
        self.hashes, self.h, self.g = hashes, h, len(fa)
        self.n = units * self.g
        self.fa, self.bs = fa, block_sizes

    def __len__(self) -> int:
        return self.n

    def key(self, i: int) -> tuple[int, bytes]:
        return i % self.g, bytes(self.hashes[i // self.g])

    def end(self, i: int) -> int:
        return (i // self.g + 1) * self.h

    def is_fa(self, i: int) -> bool:
        g = i % self.g
        return self.fa[g] and self.end(i) % self.bs[g] == 0

    def upto(self, tokens: int) -> int:
        return min(self.n, tokens // self.h * self.g)


@dataclass(eq=False, slots=True)
class _Memo:
    """One waiting request's remembered lookup: its candidates in token-end order, what each
    probe answered (absent: never asked), and the answer derived from the keys found present."""

    num_tokens: int
    n_hashes: int
    last_hash: bytes  # chained: names the whole prefix (a reused request id is a new memo)
    epoch: str
    removals: int | None
    cands: _Listed | _Units
    present: dict[int, bool] = field(default_factory=dict)
    found: set[tuple[int, bytes]] = field(default_factory=set)
    known: int = 0  # candidates [0, known) have been asked at least once
    frontier: int = -1  # first full-attention candidate last seen missing (-1: none known)
    scanned: int = 0  # candidates below this hold no missing full-attention key
    result: LookupResult = LookupResult(0)
    remembered: bool = False  # the answer relies on keys found by an earlier ask
    changes: int | None = None  # the store's change count when the last ask began (None: unknown)
    key_strings: dict[int, list[str]] = field(default_factory=dict)  # candidate -> rank keys


class StoreLookup:
    """Answers "longest loadable prefix" for a request's block hashes against a store."""

    def __init__(
        self, geo: StoreGeometry, coord: MooncakeStoreCoordinator, exists: ExistsFn,
        keys: KeySpace, world_size: int, removals: RemovalsFn | None = None,
        changes: RemovalsFn | None = None,
    ):
        self.geo = geo
        self.coord = coord
        self.exists = exists
        self.keys = keys
        self.world = world_size
        # Read, never moved, here: the scheduler role owns it (``SchedulerSide.move_epoch``).
        self.key_epoch = KeyEpoch()
        self.removals = removals or (lambda: None)
        self.changes = changes or (lambda: None)
        self.remember = True  # False: every ask probes every candidate (vLLM 0.33's way)
        self.memos: OrderedDict[str, _Memo] = OrderedDict()
        self.keys_probed = 0  # candidate keys asked (times ranks), since start
        # Full-attention store groups: their hit is a prefix (the frontier argument).
        self._fa = tuple(
            not geo.is_mamba[g] and g not in geo.window_group_ids
            and type(grp.kv_cache_spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec")
            for g, grp in enumerate(coord.kv_cache_groups))

    def _candidates(self, hashes: Sequence[bytes],
                    token_len: int) -> list[tuple[int, bytes, int]]:
        """(group, key hash, token end of the key's block) per candidate key."""
        geo = self.geo
        out: list[tuple[int, bytes, int]] = []
        if geo.partial_hits:
            h = geo.hash_block_size
            units = min(len(hashes), token_len // h)
            for g in range(geo.num_groups):
                out.extend((g, bytes(hashes[u]), (u + 1) * h) for u in range(units))
            return out
        masks = self.coord.lookup_mask(token_len)
        for g, group in enumerate(self.coord.kv_cache_groups):
            bs = geo.block_sizes[g]
            # chunk_hashes_for_block_size (mooncake/store/data.py, both releases) with the
            # spec's block size, as 0.33's MooncakeStoreCoordinator.block_hashes_for_spec did
            # (0.34 removed that method).
            ghashes = chunk_hashes_for_block_size(hashes, self.coord.hash_block_size,
                                                  group.kv_cache_spec.block_size)
            limit = min(len(ghashes), cdiv(token_len, bs))
            mask = masks[g] if masks is not None else None
            if mask is not None:
                limit = min(limit, len(mask))
            out.extend(
                (g, bytes(ghashes[i]), (i + 1) * bs) for i in range(limit)
                if mask is None or mask[i]
            )
        return out

    def present(self, hashes: Sequence[bytes], token_len: int) -> set[tuple[int, bytes]]:
        """(group, hash) pairs stored on every rank's shard (an error counts as absent)."""
        cands = [(g, hh) for g, hh, _ in self._candidates(hashes, token_len)]
        if not cands:
            return set()
        self.keys_probed += len(cands) * self.world
        keys = [
            self.keys.key(r, g, h, self.epoch)
            for g, h in cands
            for r in range(self.world)
        ]
        found = self.exists(keys)
        w = self.world
        return {c for i, c in enumerate(cands) if all(found[i * w : (i + 1) * w])}

    def lookup(self, num_tokens: int, hashes: Sequence[bytes],
               rid: str | None = None) -> LookupResult:
        """Longest aligned prefix of ``num_tokens`` tokens loadable from the store; with
        ``rid``, remembered between asks (module docstring)."""
        geo = self.geo
        token_len = geo.align_lookup_length(num_tokens)
        if not hashes or token_len <= 0:
            return LookupResult(0)
        if rid is not None and self.remember and any(self._fa):
            return self._remembered(rid, num_tokens, token_len, hashes).result
        present = self.present(hashes, token_len)
        return self._answer(num_tokens, hashes, token_len, present)

    def _answer(self, num_tokens: int, hashes: Sequence[bytes], token_len: int,
                present: set[tuple[int, bytes]]) -> LookupResult:
        """vLLM's hit search over the keys ``present`` (``MooncakeStoreWorker.lookup``)."""
        geo = self.geo
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

    @property
    def epoch(self) -> str:
        """The key epoch lookups ask under (moved by a prefix-cache reset)."""
        return self.key_epoch.value

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s remembered lookup (admitted, preempted or finished)."""
        self.memos.pop(rid, None)

    def remembered(self, rid: str) -> bool:
        """Whether ``rid``'s last answer relied on keys found present by an earlier ask."""
        memo = self.memos.get(rid)
        return memo is not None and memo.remembered

    def _new_memo(self, num_tokens: int, hashes: Sequence[bytes], token_len: int,
                  removals: int | None) -> _Memo:
        geo = self.geo
        # the keys that bound a hit: full-attention keys at block ends (with partial hits a
        # sub-block key only refines the hit inside its block)
        cands: _Listed | _Units
        if geo.partial_hits:
            units = min(len(hashes), token_len // geo.hash_block_size)
            cands = _Units(hashes, units, geo.hash_block_size, self._fa, geo.block_sizes)
        else:
            cands = _Listed(self._candidates(hashes, token_len), self._fa, geo.block_sizes)
        return _Memo(num_tokens=num_tokens, n_hashes=len(hashes),
                     last_hash=bytes(hashes[-1]), epoch=self.epoch, removals=removals,
                     cands=cands)

    def _remembered(self, rid: str, num_tokens: int, token_len: int,
                    hashes: Sequence[bytes]) -> _Memo:
        """Re-ask only what can have changed since ``rid``'s last answer."""
        changes, removals = self.changes(), self.removals()
        memo = self.memos.get(rid)
        same = (memo is not None and memo.num_tokens == num_tokens
                and memo.n_hashes == len(hashes) and memo.epoch == self.epoch
                and memo.last_hash == bytes(hashes[-1])
                # a removal the store reports is a store event: ask everything again; a store
                # that cannot report one keeps what was found (a gone key fails its load)
                and (removals is None or memo.removals == removals))
        if memo is None or not same:
            memo = self.memos[rid] = self._new_memo(num_tokens, hashes, token_len, removals)
            while len(self.memos) > MEMO_LIMIT:
                self.memos.popitem(last=False)
        else:
            self.memos.move_to_end(rid)
            if changes is not None and memo.changes == changes:
                # nothing put or dropped since the last ask began: every answer stands
                memo.remembered = memo.result.hit_length > 0
                return memo
        memo.changes = None  # set again only once this ask is complete
        first = memo.known == 0
        # Ask again the keys past the last hit that were missing (they may have been put
        # since), up to the frontier; ask new ones past what was asked, in doubling batches
        # while every full-attention key so far is present, else up to the frontier.
        cands, present = memo.cands, memo.present
        lo = cands.upto(memo.result.hit_length)
        n, batch, changed = len(cands), FIRST_BATCH, False
        earlier = memo.known  # candidates [0, earlier) were asked by an earlier ask
        while True:
            cap = self._cap(memo)
            known = memo.known
            if cap is None:
                stop, new_end = n, min(n, known + batch)
                batch *= 2
            else:
                stop = new_end = cands.upto(cap)
            # re-ask only what an earlier ask found missing: this ask's answers are fresh
            idx = [i for i in range(lo, min(stop, earlier)) if not present.get(i)]
            lo = max(lo, min(stop, earlier))
            if new_end > known:
                idx.extend(range(known, new_end))
                memo.known = new_end
            if not idx:
                break
            changed |= self._probe(memo, idx)
        if changed or first:
            try:
                memo.result = self._answer(num_tokens, hashes, token_len, memo.found)
            except Exception:
                self.memos.pop(rid, None)  # the next ask starts afresh (and fails alike)
                raise
            memo.remembered = not first and bool(memo.found)
        else:
            memo.remembered = memo.result.hit_length > 0
        memo.changes = changes
        return memo

    def _cap(self, memo: _Memo) -> int | None:
        """Last token end that can matter: the first known-missing full-attention block-end
        key's end plus one lcm block (a hit is a block prefix of every full-attention group);
        None if every such key asked so far is present."""
        i = memo.frontier
        present, cands = memo.present, memo.cands
        if i < 0 or present.get(i):  # none known yet, or the frontier key was put since
            i = max(i, memo.scanned)
            known = memo.known
            while i < known and not (present.get(i) is False and cands.is_fa(i)):
                i += 1
            memo.scanned = i
            memo.frontier = i if i < known else -1
            if memo.frontier < 0:
                return None
        return cands.end(memo.frontier) + self.geo.scheduler_block_size

    def _probe(self, memo: _Memo, idx: list[int]) -> bool:
        """Ask the store about candidates ``idx`` on every rank; True if one became present."""
        if not idx:
            return False
        w, ep, cands = self.world, self.epoch, memo.cands
        head = self.keys.head  # per group, every rank's key up to the hash
        heads = [[head(r, g, ep) for r in range(w)] for g in range(self.geo.num_groups)]
        strings = memo.key_strings  # a re-asked candidate reuses its key strings
        pairs = [cands.key(i) for i in idx]
        asked: list[str] = []
        for i, (g, hh) in zip(idx, pairs, strict=True):
            ks = strings.get(i)
            if ks is None:
                hx = hh.hex()
                ks = strings[i] = [hd + hx for hd in heads[g]]
            asked.extend(ks)
        found = self.exists(asked)
        self.keys_probed += len(idx) * w
        changed = False
        present = memo.present
        for j, i in enumerate(idx):
            ok = found[j] if w == 1 else all(found[j * w:(j + 1) * w])
            if ok and not present.get(i):
                memo.found.add(pairs[j])
                changed = True
            present[i] = ok
        return changed

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
