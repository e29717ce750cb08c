"""The mutants: plausible bugs in vLLM 0.33's own partial-tail code, one edit each.

Each mutant is a function of an installed vLLM module, an exact snippet of its source and the
replacement, written the way a reviewer of these modules would expect bugs to look: an
off-by-one at a boundary, a missed copy-on-write, a pin released early, a key left mapped after
eviction, clipping skipped, a null block accepted, a fixed point stopped early, an EAGLE margin
applied to the wrong group. Some re-introduce fixed upstream bugs (``upstream``): #43559 (in
the core coordinator and in the store's copy of its fixed point), #49502, #50359, #51358,
#51766, #52832, #54360 and #33775 (``conformance/tools/history`` lists them with their cases).
A mutant that cannot change behaviour carries the reason in ``equivalent``; it is reported,
not scored. A mutant of one release's rule (``release``, docs/releases.md) runs only where that
release is installed; the 0.34 rules' mutants edit vLLM 0.34's code, or the reference where the
rule is decided by code the adapters stand in for (``Scheduler.schedule``'s request order).
Where a later release moved or reworded the code a mutant edits, the same bug is written
again for it (``variants``: its function and snippet there); ``Mutant.at`` gives the mutant
as the installed release reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tailproof.reference.releases import RELEASES

BP = "vllm.v1.core.block_pool"
KU = "vllm.v1.core.kv_cache_utils"
KI = "vllm.v1.kv_cache_interface"
ST = "vllm.v1.core.single_type_kv_cache_manager"
CO = "vllm.v1.core.kv_cache_coordinator"
KM = "vllm.v1.core.kv_cache_manager"
SC = "vllm.v1.core.sched.scheduler"
_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store."
MS = _MOONCAKE + "scheduler"
MW = _MOONCAKE + "worker"
MCO = _MOONCAKE + "coordinator"
MD = _MOONCAKE + "data"
RQ = "vllm.v1.request"
REF_CONN = "tailproof.reference.connector.scheduler"

_LABELS = {BP: "core/block_pool", KU: "core/kv_cache_utils", KI: "kv_cache_interface",
           ST: "core/single_type_kv_cache_manager", CO: "core/kv_cache_coordinator",
           KM: "core/kv_cache_manager", SC: "core/sched/scheduler",
           MS: "mooncake/store/scheduler", MW: "mooncake/store/worker",
           MCO: "mooncake/store/coordinator", MD: "mooncake/store/data", RQ: "request",
           REF_CONN: "reference/connector/scheduler"}


def module_label(module: str) -> str:
    """Short name of a vLLM module for reports (``core/block_pool``)."""
    return _LABELS.get(module, module)


@dataclass(frozen=True)
class Variant:
    """A mutant's edit from ``release`` on, where that release moved or reworded the code it
    edits: the same bug, written against that release's source (``module`` and ``qualname``
    unset: the mutant's own)."""

    release: str
    find: str
    replace: str
    module: str | None = None
    qualname: str | None = None
    count: int = 1


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    qualname: str
    find: str
    replace: str
    why: str
    count: int = 1
    upstream: str | None = None
    equivalent: str | None = None
    release: str | None = None  # the vLLM release whose rule it breaks; None: any
    variants: tuple[Variant, ...] = ()  # its edit in later releases, oldest first

    def at(self, release: str | None) -> Mutant:
        """The mutant as ``release`` reads it: the last variant at or before it (None, or a
        release before every variant: the mutant's own edit, vLLM 0.33's)."""
        order = list(RELEASES)
        m = self
        for v in self.variants:
            if release in order and order.index(v.release) <= order.index(release):
                m = replace(m, find=v.find, replace=v.replace, count=v.count,
                            module=v.module or m.module, qualname=v.qualname or m.qualname)
        return m

    @property
    def connector_only(self) -> bool:
        """Only traces that run the Mooncake connector can observe this mutant."""
        return self.module.startswith(("vllm.distributed.", "tailproof.reference.connector"))

    @property
    def on_reference(self) -> bool:
        """A mutant of the reference model: replayed on the reference, not on vLLM."""
        return self.module.startswith("tailproof.reference")


def _m(id: str, module: str, qualname: str, find: str, replace: str, why: str,
       **kw: object) -> Mutant:
    return Mutant(id, module, qualname, find, replace, why, **kw)


MUTANTS: list[Mutant] = [
    # --- block pool -------------------------------------------------------------------------
    _m("bp-free-unhashed-to-lru-tail", BP, "BlockPool.free_blocks",
       "if block.block_hash is None or not self.enable_caching:",
       "if block.block_hash is None and not self.enable_caching:",
       "freed unhashed blocks join the LRU tail instead of the front (reuse order)",
       variants=(Variant("0.34",  # the condition gained `or evict_first`
                         "if block.block_hash is None or not self.enable_caching or evict_first:",
                         "if block.block_hash is None and not self.enable_caching or evict_first:"
                         ),)),
    _m("bp-free-lru-reversed", BP, "BlockPool.free_blocks",
       "self.free_block_queue.append_n(blocks_to_evict_last)",
       "self.free_block_queue.append_n(blocks_to_evict_last[::-1])",
       "hashed blocks enter the LRU tail in reverse eviction priority"),
    _m("bp-free-null-counted", BP, "BlockPool.free_blocks",
       "if block.is_null:  # never pooled; its ref_cnt is not maintained",
       "if False:",
       "the null block's refcount is decremented on free",
       equivalent="the null block's count only goes negative and is never read: touch and "
                  "the allocator skip it and it never re-enters the free queue"),
    _m("bp-touch-keeps-in-queue", BP, "BlockPool.touch",
       "if block.ref_cnt == 0:", "if block.ref_cnt == -1:",
       "a hit block is referenced but stays in the free queue (evictable while in use)"),
    _m("bp-reuse-keeps-keys", BP, "BlockPool.get_new_blocks",
       "self._maybe_evict_cached_block(block)", "pass",
       "a reused block keeps its prefix-cache keys (key left mapped after eviction)",
       # 0.34 calls it on two paths (with and without a metrics collector): both edited
       variants=(Variant("0.34", "self._maybe_evict_cached_block(block)", "pass", count=2),)),
    _m("bp-evict-keeps-secondary-keys", BP, "BlockPool._remove_cached_block_hashes",
       "block_hashes.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))",
       "self.cached_block_hashes_by_block.pop(block.block_id, ())",
       "eviction drops only the primary key; secondary keys stay mapped to the block"),
    _m("bp-move-primary-only", BP, "BlockPool.move_block_hashes",
       "for block_hash in self._remove_cached_block_hashes(src_block):",
       "for block_hash in self._remove_cached_block_hashes(src_block)[:1]:",
       "a running CoW moves only the primary key; secondary keys are lost"),
    _m("bp-move-copies-not-moves", BP, "BlockPool.move_block_hashes",
       "for block_hash in self._remove_cached_block_hashes(src_block):",
       "for block_hash in ([src_block.block_hash] if src_block.block_hash else []):",
       "a running CoW copies the key to the target but leaves it on the overwritten source"),
    _m("bp-full-key-tokens-off-by-one", BP, "BlockPool.cache_full_blocks",
       "num_hash_tokens = (num_cached_blocks + i + 1) * block_size",
       "num_hash_tokens = (num_cached_blocks + i) * block_size",
       "a full block's key records one block too few tokens"),
    _m("bp-promotion-keeps-partial", BP, "BlockPool.cache_full_blocks",
       "removed_hashes = self._remove_cached_block_hashes(blk)", "removed_hashes = []",
       "partial->full promotion leaves the stale partial key on the block"),
    _m("bp-partial-rekey-inverted", BP, "BlockPool.cache_partial_block",
       "and block.block_hash_num_tokens < num_hash_blocks * self.hash_block_size",
       "and block.block_hash_num_tokens > num_hash_blocks * self.hash_block_size",
       "a longer partial key does not replace the block's shorter one"),
    _m("bp-hit-needs-one-group", BP, "BlockPool.get_cached_block",
       "if not block:\n            return None", "if not block:\n            continue",
       "a prefix counts as cached when only some of the spec's groups have the key"),
    _m("bp-reset-with-blocks-held", BP, "BlockPool.reset_prefix_cache",
       "if num_used_blocks != 1:", "if num_used_blocks < 1:",
       "reset succeeds while pins or retentions still hold blocks"),
    _m("bp-evict-only-free", BP, "BlockPool.evict_blocks",
       "self._maybe_evict_cached_block(block)",
       "if block.ref_cnt == 0:\n                self._maybe_evict_cached_block(block)",
       "explicit eviction skips blocks still referenced (their keys stay)"),
    _m("bp-duplicate-key-newest", BP, "BlockHashToBlockMap.get_one_block",
       "return next(iter(blocks.values()))", "return list(blocks.values())[-1]",
       "a key with duplicate blocks hits the newest block instead of the first",
       # 0.34's map holds block ids: the first under `_cache`, all of them in `_dup_ids`
       variants=(Variant("0.34", "block_id = self._cache.get(key)",
                         "block_id = (next(reversed(self._dup_ids[key])) "
                         "if key in self._dup_ids else self._cache.get(key))"),)),
    _m("bp-pop-drops-duplicates", BP, "BlockHashToBlockMap.pop",
       "if len(blocks) > 0:", "if len(blocks) > 1:",
       "removing one of two blocks under a key drops the key for the other too",
       variants=(Variant("0.34", "del self._dup_ids[key]",
                         "del self._dup_ids[key], self._cache[key]"),)),
    # --- hashing (kv_cache_utils) ------------------------------------------------------------
    _m("ku-hash-not-chained", KU, "hash_block_tokens",
       "if not parent_block_hash:\n        parent_block_hash = NONE_HASH",
       "parent_block_hash = NONE_HASH",
       "block hashes ignore the parent (equal units at different prefixes collide)"),
    _m("ku-hasher-drops-last-unit", KU, "get_request_block_hasher",
       "if end_token_idx > num_tokens:", "if end_token_idx >= num_tokens:",
       "the hasher skips a unit that ends exactly at the last token"),
    _m("ku-coarse-view-first-unit", KU, "BlockHashListWithBlockSize._get_value_at",
       "return self.block_hashes[(idx + 1) * self.scale_factor - 1]",
       "return self.block_hashes[idx * self.scale_factor]",
       "a coarse block is keyed by its first h-unit's hash, not its last"),
    _m("ku-coarse-view-rounds-up", KU, "BlockHashListWithBlockSize.__len__",
       "return len(self.block_hashes) // self.scale_factor",
       "return -(-len(self.block_hashes) // self.scale_factor)",
       "the coarse view counts a partly hashed block as a whole block"),
    _m("ku-eagle-margin-whole-block", KU, "eagle_proof_margin",
       "return hash_block_size", "return block_size",
       "the fine-grained EAGLE proof margin is a whole block, not one hash unit"),
    _m("ku-partial-hits-at-equal-size", KU, "partial_hash_hits_enabled",
       "(dcp_world_size == 1 and spec.block_size > hash_block_size)",
       "(dcp_world_size == 1 and spec.block_size >= hash_block_size)",
       "partial hits switch on when h equals the Mamba block size"),
    _m("ku-fine-view-at-block-alignment", KU, "resolve_block_hashes",
       "and alignment_tokens < block_size", "and alignment_tokens <= block_size",
       "a group whose alignment is its block size gets the raw h-hashes, not the block view"),
    # --- checkpoint arithmetic (kv_cache_interface) ------------------------------------------
    _m("ki-ck-forgets-recompute", KI, "get_mamba_prefill_checkpoint_position",
       "else num_tokens - max(1, num_hash_lookahead_tokens)",
       "else num_tokens - num_hash_lookahead_tokens",
       "ck(P) forgets the last token recomputed for logits (ck = floor(P/h)*h)"),
    _m("ki-ck-eagle-no-drop", KI, "get_mamba_prefill_checkpoint_position",
       "if drop_eagle_block:\n        checkpoint_position -= hash_block_size",
       "if False:\n        checkpoint_position -= hash_block_size",
       "the EAGLE checkpoint is not moved one hash unit down",
       upstream="#54360 (MTP/DFlash zero hybrid hits for some prompt lengths; #52244's "
                "mechanism: the tail state published where the EAGLE-rewound lookup misses it)"),
    # --- single-type managers: base / full attention -----------------------------------------
    _m("st-cow-block-not-reserved", ST, "SingleTypeKVCacheManager.get_num_blocks_to_allocate",
       "num_new_blocks += 1", "num_new_blocks += 0",
       "admission does not reserve the block a partial hit's CoW takes"),
    _m("st-evictable-hits-not-counted", ST,
       "SingleTypeKVCacheManager.get_num_blocks_to_allocate",
       "return num_new_blocks + num_evictable_blocks", "return num_new_blocks",
       "hit blocks sitting in the free queue are not counted against free capacity"),
    _m("st-hit-not-touched", ST, "SingleTypeKVCacheManager.add_local_computed_blocks",
       "self.block_pool.touch(new_computed_blocks)", "pass",
       "a prefix hit is adopted without taking a reference"),
    _m("st-partial-hit-cached-count-uncapped", ST,
       "SingleTypeKVCacheManager.add_local_computed_blocks",
       "self.num_cached_block[request_id] = block_idx", "pass",
       "a partial hit's private copy is never re-cached once full"),
    _m("st-missed-cow", ST, "SingleTypeKVCacheManager.allocate_new_blocks",
       "self._apply_cow(request_id, block_idx, source_block, cow_block)", "pass",
       "a partial attention hit writes into the shared block (missed CoW)"),
    _m("st-cow-target-not-retained", ST, "SingleTypeKVCacheManager._apply_cow",
       "cow_block.ref_cnt += 1", "pass",
       "the CoW target gets no retention ref (released with the copy, still in the table)"),
    _m("st-cow-copy-not-queued", ST, "SingleTypeKVCacheManager._apply_cow",
       "self._pending_cow_copies.append((source_block, cow_block))", "pass",
       "the CoW redirect is made but the copy is never queued"),
    _m("st-cache-past-hashes", ST, "SingleTypeKVCacheManager.cache_blocks",
       "num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size",
       "num_full_blocks = num_tokens // self.block_size",
       "blocks are cached up to the computed tokens, not the hashed ones",
       equivalent="block sizes are multiples of h, so floor(min(n, floor(n/h)h)/B) = "
                  "floor(n/B); they differ only with hash lookahead tokens, which the "
                  "stand-in request hasher does not use"),
    _m("st-free-keeps-partial-hit", ST, "SingleTypeKVCacheManager.pop_blocks_for_free",
       "self._partial_hit_reqs.pop(request_id, None)", "pass",
       "a freed request's pending CoW survives into its next life"),
    _m("st-free-not-reversed", ST, "SingleTypeKVCacheManager.free",
       "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
       "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))",
       "a request's blocks are freed head first (the shared prefix is evicted first)"),
    _m("fa-hit-past-max-length", ST, "FullAttentionManager.find_longest_cache_hit",
       "itertools.islice(full_block_hashes, max_length // block_size)",
       "itertools.islice(full_block_hashes, cdiv(max_length, block_size))",
       "the full-block scan may cover the token that must be recomputed"),
    _m("fa-probe-block-end", ST, "FullAttentionManager.find_longest_cache_hit",
       "first_partial_idx + scale_factor - 1,", "first_partial_idx + scale_factor,",
       "the interior probe also tries the block-end hash",
       equivalent="the block-end hash of the first non-full block is the key phase 1 just "
                  "missed, or lies past max_length"),
    _m("fa-probe-shortest-first", ST, "FullAttentionManager.find_longest_cache_hit",
       "for fine_idx in range(max_partial_idx - 1, first_partial_idx - 1, -1):",
       "for fine_idx in range(first_partial_idx, max_partial_idx):",
       "the interior probe takes the shortest cached boundary, not the longest"),
    _m("fa-eagle-drops-block", ST, "FullAttentionManager.find_longest_cache_hit",
       "hit_length -= min(alignment_tokens, block_size)", "hit_length -= block_size",
       "the fine-grained EAGLE drop removes a whole block"),
    _m("fa-partial-tail-block-dropped", ST, "FullAttentionManager.find_longest_cache_hit",
       "num_blocks = cdiv(hit_length, block_size)", "num_blocks = hit_length // block_size",
       "a hit ending inside a block loses that block"),
    _m("fa-tail-key-at-prompt-end", ST, "FullAttentionManager._cache_partial_tail_block",
       "else request.num_prompt_tokens - 1", "else request.num_prompt_tokens",
       "the attention partial tail is keyed at floor(P/h)h instead of floor((P-1)/h)h"),
    _m("fa-tail-key-on-aligned-boundary", ST, "FullAttentionManager._cache_partial_tail_block",
       "if boundary_tokens % self.block_size == 0:\n        return",
       "if False:\n        return",
       "a block-aligned tail boundary is keyed as a partial entry on the next block"),
    # --- single-type managers: Mamba align ---------------------------------------------------
    _m("m-hit-skips-top-boundary", ST, "MambaManager.find_longest_cache_hit",
       "for fine_idx in range(max_num_partial_units - 1, -1, -1):",
       "for fine_idx in range(max_num_partial_units - 2, -1, -1):",
       "the Mamba scan starts one hash unit below the highest allowed boundary"),
    _m("m-hit-past-max-length", ST, "MambaManager.find_longest_cache_hit",
       "max_length // hash_block_size, len(block_hashes)",
       "max_length // hash_block_size + 1, len(block_hashes)",
       "a Mamba state one hash unit past the cap is accepted"),
    _m("m-coarse-alignment-inverted", ST, "MambaManager.find_longest_cache_hit",
       "and (i + 1) * block_size % alignment_tokens != 0",
       "and (i + 1) * block_size % alignment_tokens == 0",
       "without partial hits the Mamba scan keeps only boundaries off the lcm grid"),
    _m("m-no-same-step-deferral", ST, "MambaManager.get_num_blocks_to_allocate",
       "new_computed_blocks[-1].block_hash in self.cached_blocks_this_step",
       "new_computed_blocks[-1].block_hash in ()",
       "a Mamba state registered or moved this step is hit in the same step"),
    _m("m-cow-target-not-reserved", ST, "MambaManager.get_num_blocks_to_allocate",
       "if has_partial_hit:\n            num_new_blocks = max(num_new_blocks, 0) + 1",
       "if has_partial_hit:\n            num_new_blocks = max(num_new_blocks, 0)",
       "a Mamba partial hit does not reserve its CoW target"),
    _m("m-running-cow-not-reserved", ST, "MambaManager.get_num_blocks_to_allocate",
       "or request_id in self._partial_hit_reqs", "",
       "a producer's running CoW (its own tail) does not reserve the copy target"),
    _m("m-evictable-hits-not-counted", ST, "MambaManager.get_num_blocks_to_allocate",
       "return num_new_blocks + num_evictable_computed_blocks", "return num_new_blocks",
       "a Mamba hit block in the free queue is not counted against free capacity"),
    _m("m-51766-no-alloc-mark", ST, "MambaManager.allocate_new_blocks",
       "self._allocated_block_reqs.add(request_id)\n            return []",
       "return []",
       "a request continuing in its externally loaded block is not marked allocated, so "
       "its later tail CoW is taken as a first allocation",
       upstream="#51766 (Preserve Mamba running CoW after external hits)"),
    _m("m-running-cow-no-key-move", ST, "MambaManager.allocate_new_blocks",
       "self.block_pool.move_block_hashes(source_block, cow_block)", "pass",
       "a running CoW leaves the tail key on the block the forward overwrites"),
    _m("m-running-cow-source-not-retained", ST, "MambaManager.allocate_new_blocks",
       "source_block.ref_cnt += 1", "pass",
       "the running CoW's source is released before its copy ran (pin released early)"),
    _m("m-handoff-gives-source", ST, "MambaManager.allocate_new_blocks",
       "cow_block,\n                                boundary_tokens,",
       "source_block,\n                                boundary_tokens,",
       "the tail hand-off names the overwritten source instead of the CoW target"),
    _m("m-moved-key-not-deferred", ST, "MambaManager.allocate_new_blocks",
       "self.cached_blocks_this_step.add(cow_block.block_hash)", "pass",
       "a key moved to the CoW target is hit in the step whose copy fills it"),
    _m("m-first-cow-not-returned", ST, "MambaManager.allocate_new_blocks",
       "returned_blocks = [cow_block] + returned_blocks", "pass",
       "a first-allocation CoW target is not reported as a new block"),
    _m("m-last-state-idx-off-by-one", ST, "MambaManager.allocate_new_blocks",
       "prev_block_len - 1 - self.num_speculative_blocks",
       "prev_block_len - self.num_speculative_blocks",
       "the previous running state is recorded one slot too far (frees the wrong block)",
       equivalent="without prefill checkpoint blocks the entry at prev_block_len - S is, after "
                  "the allocation, null (a passed scratch block, relocated) or the new running "
                  "state, which the processed tokens cannot pass before the next allocation "
                  "resets the index; and super().remove_skipped_blocks frees every non-null "
                  "entry below cdiv(processed, B) - 1, the correct index's included, in the "
                  "same call (S = 0..3 checked on generated traces)"),
    _m("m-prev-state-freed-early", ST, "MambaManager.remove_skipped_blocks",
       "< cdiv(processed_computed_tokens, self.block_size) - 1",
       "<= cdiv(processed_computed_tokens, self.block_size) - 1",
       "the previous running state is freed one step early"),
    _m("m-retired-count-not-kept", ST, "MambaManager._remove_blocks_in_range",
       "self._num_retired_blocks[request_id] = last_block", "pass",
       "the retired-prefix counter is not advanced",
       equivalent="the retired prefix holds only null blocks, which the loop skips; the "
                  "counter only saves the rescan"),
    _m("m-skips-last-state", ST, "MambaManager.get_num_skipped_tokens",
       "return num_computed_tokens - 1", "return num_computed_tokens",
       "the state of the last computed token counts as skipped"),
    _m("m-49502-tail-only-on-cow", ST, "MambaManager.finalize_partial_tail_offload",
       "if num_in_flight_tokens != 0 or num_computed_tokens != boundary_tokens:",
       "if True:",
       "a producer's partial-tail marker becomes a hand-off only on a later CoW: a request "
       "that finishes at its checkpoint (max_tokens=1) drops it at free",
       upstream="#49502 (reliable partial-tail offload for sub-block prompts, max_tokens=1)"),
    _m("m-finalize-ignores-in-flight", ST, "MambaManager.finalize_partial_tail_offload",
       "if num_in_flight_tokens != 0 or num_computed_tokens != boundary_tokens:",
       "if num_computed_tokens != boundary_tokens:",
       "a finish-time tail is handed off while later tokens are in flight"),
    _m("m-finalize-marker-not-consumed", ST, "MambaManager.finalize_partial_tail_offload",
       "producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)",
       "producer_tail = self._producer_partial_tail_reqs.get(request_id)",
       "the producer marker is not consumed at finish (a second hand-off is possible)"),
    _m("m-free-keeps-handoffs", ST, "MambaManager.pop_blocks_for_free",
       "if entry[0] != request_id", "if True",
       "a freed request's undrained hand-offs are still offered"),
    _m("m-free-keeps-marker", ST, "MambaManager.pop_blocks_for_free",
       "self._producer_partial_tail_reqs.pop(request_id, None)", "pass",
       "a freed or preempted request keeps its producer marker"),
    _m("m-snapshots-not-offered", ST, "MambaManager.cache_blocks",
       "self._pending_boundary_state_offloads.append(",
       "(lambda *entry: None)(",
       "block-aligned Mamba snapshots are never handed off"),
    _m("m-tail-at-any-boundary", ST, "MambaManager._cache_partial_tail_block",
       "if num_tokens != latest_prompt_hash_boundary and not (",
       "if num_tokens > latest_prompt_hash_boundary and not (",
       "a sub-block tail is registered at every chunk end below ck(P)"),
    _m("m-tail-rekeyed", ST, "MambaManager._cache_partial_tail_block",
       "if source_block.block_hash_num_tokens == num_tokens:\n        return None",
       "if False:\n        return None",
       "a block already keyed at the boundary is registered again (and marked producer)"),
    _m("m-aligned-tail-as-partial", ST, "MambaManager._cache_partial_tail_block",
       "if partial_hash is not None and num_tokens % self.block_size:",
       "if partial_hash is not None:",
       "a block-aligned checkpoint is treated as a sub-block tail (needless CoW)"),
    _m("m-tail-cached-count-uncapped", ST, "MambaManager._cache_partial_tail_block",
       "self.num_cached_block[request.request_id] = block_idx", "pass",
       "the producer's tail block is never re-registered once full",
       equivalent="the base cache_blocks call just before has set num_cached_block to "
                  "floor(ck/B), which is block_idx for a sub-block ck"),
    _m("m-deferral-never-lifted", ST, "MambaManager.new_step_starts",
       "self.cached_blocks_this_step.clear()", "pass",
       "states registered in one step stay unhittable in every later step"),
    # --- coordinator -------------------------------------------------------------------------
    _m("co-43559-eagle-margin-on-mamba", CO, "HybridKVCacheCoordinator.find_longest_cache_hit",
       "if drop_eagle_block and not isinstance(spec, MambaSpec):", "if drop_eagle_block:",
       "an EAGLE Mamba group gets the lookup margin it never drops, so the hit grows past the "
       "attention-verified candidate",
       upstream="#43559 (MTP + prefix caching + Mamba accuracy drop)"),
    _m("co-fixed-point-one-pass", CO, "HybridKVCacheCoordinator.find_longest_cache_hit",
       "if is_simple_hybrid:\n            break", "break",
       "the hit fixed point stops after one pass with three or more spec groups"),
    _m("co-eagle-verified-kept", CO, "HybridKVCacheCoordinator.find_longest_cache_hit",
       "eagle_verified.clear()", "pass",
       "a shrunk candidate keeps earlier EAGLE verifications (no re-drop)"),
    _m("co-no-clipping", CO, "HybridKVCacheCoordinator.find_longest_cache_hit",
       "del blks[num_blocks:]", "pass",
       "attention hits are not clipped to the joint hit (clipping skipped)"),
    _m("co-eagle-cacheable-no-block", CO, "HybridKVCacheCoordinator.get_num_cacheable_tokens",
       "+ manager.block_size,", "+ 0,",
       "an EAGLE group does not cache the block past the aligned boundary"),
    _m("co-partial-cacheable-rounded", CO, "HybridKVCacheCoordinator._align_cacheable",
       "if self.enable_partial_hash_hits:\n        return num_tokens",
       "if False:\n        return num_tokens",
       "with partial hits the cacheable prefix is still rounded to the lcm"),
    _m("co-33775-one-phase-adoption", CO, "KVCacheCoordinator.allocate_new_computed_blocks",
       "    if num_external_computed_tokens > 0:\n"
       "        for i, manager in enumerate(self.single_type_managers):\n",
       "        if num_external_computed_tokens > 0:\n",
       "external blocks of one group are allocated before the next group's hits are touched",
       upstream="#33775 (two-phase adoption; the fix vLLM 0.33 cites in this function)"),
    # --- KV cache manager --------------------------------------------------------------------
    _m("km-hit-covers-last-token", KM, "KVCacheManager.get_computed_blocks",
       "max_cache_hit_length = request.num_tokens - 1",
       "max_cache_hit_length = request.num_tokens",
       "a full prefix hit leaves no token to recompute for logits",
       # 0.34 takes the bound from Request.get_max_cache_hit_length
       variants=(Variant("0.34",
                         "limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)",
                         "limits = (self.num_tokens, self.prefix_cache_hit_limit, bound)",
                         module=RQ, qualname="Request.get_max_cache_hit_length"),)),
    _m("km-skip-ignores-in-flight", KM, "KVCacheManager.allocate_slots",
       "max(0, total_computed_tokens - request.num_in_flight_tokens),",
       "total_computed_tokens,",
       "blocks still read by in-flight steps are freed as skipped"),
    _m("km-caches-uncommitted", KM, "KVCacheManager.allocate_slots",
       "num_tokens_to_cache = min(\n        total_computed_tokens + num_new_tokens,\n"
       "        request.num_tokens,\n    )",
       "num_tokens_to_cache = total_computed_tokens + num_new_tokens",
       "draft or lookahead tokens are cached as if committed",
       equivalent="every registration is bounded by the request's hashes (full blocks) or "
                  "by the prompt (tail keys), and scheduled drafts extend neither"),
    _m("km-delay-cache-ignored", KM, "KVCacheManager.allocate_slots",
       "if delay_cache_blocks:\n        return", "if False:\n        return",
       "blocks waiting for remote KV are cached before it arrives"),
    _m("km-external-only-not-adopted", KM, "KVCacheManager.allocate_slots",
       "new_computed_block_list is not self.empty_kv_cache_blocks.blocks\n"
       "        or num_external_computed_tokens > 0",
       "new_computed_block_list is not self.empty_kv_cache_blocks.blocks",
       "an external-only admission skips the external block allocation"),
    _m("km-truncate-keeps-all", KM, "KVCacheManager.truncate_computed_blocks",
       "truncated.append(list(group_blocks[:num_blocks]))",
       "truncated.append(list(group_blocks))",
       "truncating a local hit to the aligned prefix keeps the sub-block tail"),
    _m("km-source-retention-leaks", KM, "KVCacheManager.take_kv_cache_block_copies",
       "retained_blocks = [block for pair in pending_copies for block in pair]",
       "retained_blocks = [pair[1] for pair in pending_copies]",
       "a copy's source is never released (retention leak)"),
    # --- scheduler split ---------------------------------------------------------------------
    _m("sc-no-tail-stop", SC, "Scheduler._mamba_block_aligned_split",
       "if last_cache_position < tail_boundary < request.num_prompt_tokens",
       "if last_cache_position < tail_boundary < 0",
       "the chunk does not stop at the prompt's partial-tail checkpoint ck(P)"),
    _m("sc-mid-block-runs-on", SC, "Scheduler._mamba_block_aligned_split",
       "if start % block_size != 0 and not use_internal_checkpoint",
       "if False and not use_internal_checkpoint",
       "a chunk starting mid-block runs past the next block boundary"),
    _m("sc-unaligned-chunk-end", SC, "Scheduler._mamba_block_aligned_split",
       "aligned_end = end // block_size * block_size", "aligned_end = end",
       "an intermediate prefill chunk ends off the Mamba block grid"),
    _m("sc-splits-decode", SC, "Scheduler._mamba_block_aligned_split",
       "if start >= prefill_end:", "if start > prefill_end:",
       "the first step at the prefill end is still split (drafts get clipped)"),
    _m("sc-long-prefill-ignored", SC, "Scheduler._mamba_block_aligned_split",
       "if long_prefill_threshold > 0:", "if long_prefill_threshold < 0:",
       "the long-prefill threshold is ignored when a block exceeds the chunk limit"),
    _m("sc-last-cache-position-skipped", SC, "Scheduler._mamba_block_aligned_split",
       "        last_cache_position,\n", "        0,\n",
       "the chunk does not stop at the last cacheable block boundary"),
    _m("sc-junction-block-ceil", SC, "Scheduler._mamba_block_aligned_split",
       "block_floored = start + (junction - start) // block_size * block_size",
       "block_floored = start + -(-(junction - start) // block_size) * block_size",
       "a sub-block shared-prefix junction stops the chunk at the next block, past it",
       upstream="#45238 (align checkpoint in request-unique tokens: shared-prefix junction)"),
    # --- Mooncake store scheduler ------------------------------------------------------------
    _m("ms-tail-puts-no-margin", MS, "_partial_tail_non_mamba_puts",
       "proof_end = boundary + coord.eagle_proof_margin_by_group.get(group_id, 0)",
       "proof_end = boundary",
       "attention tail puts stop at the checkpoint without the EAGLE proof margin"),
    _m("ms-tail-puts-margin-wrong-group", MS, "_partial_tail_non_mamba_puts",
       "proof_end = boundary + coord.eagle_proof_margin_by_group.get(group_id, 0)",
       "proof_end = boundary + max(coord.eagle_proof_margin_by_group.values(), default=0)",
       "every attention group gets the EAGLE margin, not only the EAGLE groups"),
    _m("ms-tail-puts-from-boundary-block", MS, "_partial_tail_non_mamba_puts",
       "start = boundary // coord.lcm_block_size * coord.lcm_block_size",
       "start = boundary // block_sizes[0] * block_sizes[0]",
       "attention tail puts start at the first group's block floor, not the lcm floor"),
    _m("ms-tail-puts-null-accepted", MS, "_partial_tail_non_mamba_puts",
       "if block_id == NULL_BLOCK_ID:\n                continue", "pass",
       "a null attention block is published as a tail put"),
    _m("ms-tail-puts-uncomputed", MS, "_partial_tail_non_mamba_puts",
       "if proof_end > completed or proof_end // hash_block_size > num_hashes:",
       "if proof_end // hash_block_size > num_hashes:",
       "attention KV not yet computed is published as a tail put"),
    _m("ms-tail-puts-for-junction", MS, "_partial_tail_non_mamba_puts",
       "if not req_meta.publish_partial_tail and boundary not in mamba_tails:",
       "if False:",
       "a shared-prefix junction hand-off also publishes the prompt's attention tail"),
    _m("ms-lookup-not-subtracted", MS, "MooncakeStoreScheduler.get_num_new_matched_tokens",
       "need_to_allocate = num_external_hit_tokens - num_computed_tokens",
       "need_to_allocate = num_external_hit_tokens",
       "the external hit is reported without subtracting the local hit"),
    _m("ms-lookup-coarse-floor", MS, "MooncakeStoreScheduler.get_num_new_matched_tokens",
       "self._hash_block_size if self.enable_partial_hash_hits else self._block_size",
       "self._block_size",
       "prompts shorter than one lcm block are never looked up, even with partial hits",
       variants=(Variant("0.34", "self._hash_block_size if self.enable_partial_hash_hits "
                         "else self._block_size", "self._block_size",
                         qualname="MooncakeStoreScheduler._lookup_align"),)),
    _m("ms-claims-decode-boundary", MS, "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if boundary_tokens > tracker.prefill_end_tokens:",
       "if boundary_tokens > tracker.prefill_end_tokens + 10**9:",
       "decode-time Mamba snapshots are claimed and pinned (0.34: without save_decode_cache)",
       variants=(Variant("0.34", "if is_decode_boundary and not self.save_decode_cache:",
                         "if False:"),)),
    _m("ms-handoff-null-accepted", MS, "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if block_id == NULL_BLOCK_ID:\n                continue", "pass",
       "a hand-off naming the null block is accepted"),
    _m("ms-handoff-any-group", MS, "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if store_group_id not in self._boundary_state_group_ids:\n                continue",
       "pass",
       "a hand-off for a non-Mamba (or non-cacheable) group is accepted"),
    _m("ms-handoff-after-preempt", MS, "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if tracker is None or req_tuple is None:", "if tracker is None:",
       "hand-offs of a request preempted this step are still processed",
       equivalent="a preempted request's tracker is reset (prefill_end_tokens 0) in the same "
                  "call, so every entry fails the prefill-end filter before the missing "
                  "request entry is read; a finished request has no tracker at all"),
    _m("ms-pin-not-taken", MS, "MooncakeStoreScheduler._reference_save_blocks",
       "pool.touch([pool.blocks[block_id] for block_id in block_ids])", "pass",
       "a store job records its blocks but takes no reference (drop pin)"),
    _m("ms-pins-mamba-table", MS, "MooncakeStoreScheduler._reference_save_blocks",
       "if group_id not in self._boundary_state_group_ids", "if True",
       "a normal save also pins the Mamba table positionally"),
    _m("ms-pins-not-deduped", MS, "MooncakeStoreScheduler._reference_save_blocks",
       "block_ids = list(dict.fromkeys(block_ids))", "block_ids = list(block_ids)",
       "a block both in the table and in a put is pinned twice"),
    _m("ms-unpin-first-report", MS, "MooncakeStoreScheduler.update_connector_output",
       "remaining -= count", "remaining = 0",
       "a job's pins are released at the first rank's report, not the last"),
    _m("ms-unpin-head-first", MS, "MooncakeStoreScheduler.update_connector_output",
       "for bid in reversed(block_ids)", "for bid in block_ids",
       "released pins free the shared prefix first"),
    _m("ms-52832-no-finish-tail", MS, "MooncakeStoreScheduler.register_finished_partial_tail",
       "if self.kv_role == \"kv_consumer\" or not partial_tail_offloads:", "if True:",
       "a producer that finishes at its checkpoint never offloads the tail",
       upstream="#52832 (Offload producer partial tails on request finish)"),
    _m("ms-finish-tail-not-pinned", MS, "MooncakeStoreScheduler.register_finished_partial_tail",
       "pool.touch([pool.blocks[block_id] for block_id in pinned_block_ids])", "pass",
       "a finish-time tail is queued but not pinned before the request's blocks are freed"),
    _m("ms-preempt-keeps-tracker", MS, "MooncakeStoreScheduler.build_connector_meta",
       "request_tracker.reset()", "pass",
       "a preempted request keeps its save tracker (0.34 pops it instead: "
       "ms-034-preempt-keeps-tracker)", release="0.33"),
    _m("ms-consumer-claims", MS, "MooncakeStoreScheduler.build_connector_meta",
       "and not is_consumer\n    ):", "\n    ):",
       "a consumer claims and pins boundary-state hand-offs (0.34 decides it per boundary "
       "inside _handle_boundary_state_offloads: ms-034-consumer-stores-prompt-boundary)",
       release="0.33"),
    _m("ms-saves-decode", MS, "MooncakeStoreScheduler.build_connector_meta",
       "if is_decode and not self.save_decode_cache:", "if False:",
       "decode steps emit normal saves without save_decode_cache"),
    _m("md-tail-published-twice", MD, "ReqMeta.from_request_tracker",
       "and not tracker.partial_tail_sent", "",
       "the prompt's partial tail is published by every later save"),
    _m("mco-43559-eagle-margin-on-mamba", MCO, "MooncakeStoreCoordinator._find_hit_blocks",
       "if drop_eagle_block and not isinstance(spec, MambaSpec):", "if drop_eagle_block:",
       "the store lookup gives an EAGLE Mamba group the margin it never drops",
       upstream="#43559 (MTP + prefix caching + Mamba accuracy drop), store-side copy"),
    _m("mco-51358-positional-mamba-save", MCO, "MooncakeStoreCoordinator.store_mask",
       "exclude_mamba=True", "exclude_mamba=False",
       "the normal save resolves Mamba sources positionally from the append-only block-id "
       "mirror (null, freed or speculative blocks saved under a valid hash)",
       upstream="#51358 (Save exact Mamba boundary states)"),
    _m("mco-lookup-length-unaligned", MCO, "MooncakeStoreCoordinator.align_lookup_length",
       "return length // alignment * alignment", "return length",
       "the store lookup length is not floored to the hit alignment"),
    # --- Mooncake store worker ---------------------------------------------------------------
    _m("mw-failed-boundary-still-saves", MW, "KVCacheStoreSendingThread._handle_request",
       "if not self._maybe_offload_boundary_states(req_meta):\n            return",
       "self._maybe_offload_boundary_states(req_meta)",
       "a failed boundary put does not skip the job's normal save"),
    _m("mw-pressure-gate-off", MW, "KVCacheStoreSendingThread._should_skip_request",
       "return self._store_pressure_active and req_id in self._skip_store_requests",
       "return False",
       "jobs of a request that hit -200 keep putting under store pressure"),
    _m("mw-pressure-skip-set-kept", MW, "KVCacheStoreSendingThread._clear_store_pressure",
       "self._skip_store_requests.clear()", "pass",
       "clearing store pressure leaves requests in the skip set"),
    _m("mw-not-live-job-runs", MW, "KVCacheStoreSendingThread._handle_request",
       "if not self.is_live_store_job(req_meta):\n            return",
       "if False:\n            return",
       "a job of a preempted or retired request still puts"),
    _m("mw-boundary-null-put", MW, "KVCacheStoreSendingThread._boundary_puts",
       "or block_id == NULL_BLOCK_ID", "",
       "a boundary put naming the null block is executed",
       equivalent="dead in vLLM 0.33: every job the worker runs was emitted with can_save, "
                  "and the store scheduler's _reference_save_blocks asserts that no boundary "
                  "put of such a job names NULL_BLOCK_ID before the job leaves the scheduler "
                  "(a retried job keeps the puts checked at its first emission)"),
    _m("mw-boundary-not-deduped", MW, "KVCacheStoreSendingThread._maybe_offload_boundary_states",
       "missing = [i for i, e in enumerate(exists) if e != 1]",
       "missing = list(range(len(exists)))",
       "boundary keys already in the store are put again"),
    _m("mw-boundary-pressure-unmarked", MW,
       "KVCacheStoreSendingThread._maybe_offload_boundary_states",
       "if MOONCAKE_NO_AVAILABLE_HANDLE in failed_codes:\n"
       "            self._mark_request_skipped_for_pressure(req_meta)",
       "if False:\n            self._mark_request_skipped_for_pressure(req_meta)",
       "a -200 on a boundary put does not open the pressure gate"),
    _m("mw-null-chunk-saved", MW, "KVCacheStoreSendingThread._handle_request",
       "if block_idx >= len(group_blocks) or (\n"
       "                    group_blocks[block_idx] == NULL_BLOCK_ID\n"
       "                ):",
       "if block_idx >= len(group_blocks):",
       "a normal save reads a null source block"),
    _m("mw-partial-failure-advances", MW, "KVCacheStoreSendingThread._handle_request",
       "if not put_had_exception and not failed_indices:", "if not put_had_exception:",
       "a partially failed normal save advances the resume offset",
       variants=(Variant("0.34", "    and not failed_indices\n", ""),)),
    _m("mw-finished-retired-early", MW, "MooncakeStoreWorker._close_ended_store_requests",
       "if self.kv_send_thread.stored_requests.get(req_id):", "if False:",
       "a finished request's ledger is deleted while its jobs are queued",
       variants=(Variant("0.34", "req_id in pending_save_req_ids\n"
                         "            or self.kv_send_thread.stored_requests.get(req_id)",
                         "False"),)),
    _m("mw-lookup-full-hit-kept", MW, "MooncakeStoreWorker.lookup",
       "if hit_length >= num_tokens:", "if hit_length > num_tokens:",
       "a store hit covering the whole request is not re-derived below its end",
       variants=(Variant("0.34", "if hit_length >= num_tokens:", "if hit_length > num_tokens:",
                         qualname="MooncakeStoreWorker._longest_hit"),)),
    _m("mw-lookup-any-rank", MW, "MooncakeStoreWorker.lookup",
       "if all(res[pos + j] == 1 for j in range(count)):",
       "if any(res[pos + j] == 1 for j in range(count)):",
       "a key counts as present when any rank's shard is",
       variants=(Variant("0.34", "present = all(res[pos + j] == 1 for j in range(count))",
                         "present = any(res[pos + j] == 1 for j in range(count))"),)),
    _m("mw-50359-tail-key-at-hit", MW, "MooncakeStoreWorker._tail_key_boundaries",
       "if not contains_hit_boundary:\n            next_chunk_hash_idx", "if False:\n"
       "            next_chunk_hash_idx",
       "a reconciled hit inside a group's block names that group's key at the hit itself, "
       "which no object has (FA stored at 32/64, Mamba at 32/48: the hit 48 is not loadable)",
       upstream="#50359 (Revalidate exact partial-hash hit boundaries; port #52272)"),
    _m("mw-tail-key-skips-next", MW, "MooncakeStoreWorker._tail_key_boundaries",
       "for hash_idx in range(hit_boundary_hash_idx + 1, next_chunk_hash_idx):",
       "for hash_idx in range(hit_boundary_hash_idx + 2, next_chunk_hash_idx):",
       "the tail key search skips the first boundary after the hit (EAGLE proof key)",
       upstream="#56615 (EAGLE tail stored at B missed by the B+H attention probe)"),
    # --- vLLM 0.34's rules (docs/releases.md) ---------------------------------------------------
    _m("ms-034-56972-decode-checkpoint-dropped", MS,
       "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if is_decode_boundary and not self.save_decode_cache:", "if is_decode_boundary:",
       "decode-time Mamba states are dropped even with save_decode_cache (reverts the fix)",
       upstream="#56972 (decode-time Mamba states never stored), fixed in 0.34",
       release="0.34"),
    _m("ms-034-consumer-stores-prompt-boundary", MS,
       "MooncakeStoreScheduler._handle_boundary_state_offloads",
       "if not is_decode_boundary and self.kv_role == \"kv_consumer\":", "if False:",
       "a consumer saving decode KV also claims and pins prompt-time boundary states",
       release="0.34"),
    _m("ms-034-resumed-prefill-ends-at-prompt", MS, "MooncakeStoreScheduler.build_connector_meta",
       "prefill_end_tokens=len(prefill_tokens),",
       "prefill_end_tokens=request_real.num_prompt_tokens,",
       "a resumed request (now a new one) ends its prefill at the prompt: the boundaries of "
       "its replayed outputs are dropped as decode ones",
       release="0.34"),
    _m("ms-034-preempt-keeps-tracker", MS, "MooncakeStoreScheduler.build_connector_meta",
       "self._request_trackers.pop(req_id, None)", "pass",
       "a preempted request keeps its save tracker (neither dropped nor reset)",
       release="0.34"),
    _m("mw-034-missing-source-advances", MW, "KVCacheStoreSendingThread._handle_request",
       "            and not missing_source_blocks\n        ):", "        ):",
       "a save that skipped a missing source block still advances the offset (and clears "
       "the pressure gate): the skipped range is never retried",
       release="0.34"),
    _m("mw-034-offset-takes-min", MW, "KVCacheStoreSendingThread._record_saved_offset",
       "= max(", "= min(",
       "the resume offset keeps the smaller of the old and the new one: it never moves "
       "forward, and every job saves again from the start",
       release="0.34"),
    _m("mw-034-offset-overwritten", MW, "KVCacheStoreSendingThread._record_saved_offset",
       "self._saved_offset.get(req_meta.req_id, 0), offset", "offset, offset",
       "the resume offset is overwritten with the job's length instead of only moving forward",
       release="0.34",
       equivalent="_handle_request returns before any save when the job's checkpoint is at "
                  "or below the offset, so a recorded length is never below it: max() "
                  "guards nothing a single sending thread can reach"),
    _m("mw-034-deduped-save-ignores-missing-source", MW,
       "KVCacheStoreSendingThread._handle_request",
       "save_completed = not missing_source_blocks", "save_completed = True",
       "a save whose keys were all stored already (or that had none to put) counts as "
       "complete though a source block was missing: the offset moves past the gap",
       count=2, release="0.34"),
    _m("rq-034-bound-unclamped", RQ, "Request.get_max_cache_hit_length",
       "limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)",
       "limits = (self.num_tokens - 1 if bound is None else None, "
       "self.prefix_cache_hit_limit, bound)",
       "an explicit lookup bound is not clamped, so a hit may cover the last token",
       release="0.34"),
    _m("ref-034-resumed-after-running", REF_CONN, "ConnectorScheduler.build_connector_meta",
       "as_new = (\"new\", \"resumed\") if self.rules.resumed_as_new else (\"new\",)",
       "as_new = (\"new\",)",
       "0.34's resumed requests are handled after the running ones, as 0.33's cached rows "
       "(Scheduler.schedule decides the order; the adapters stand in for it)",
       release="0.34"),
]
