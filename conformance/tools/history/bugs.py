"""One entry per upstream bug of the partial-tail / hybrid-prefix-cache path (issue 21), and
the bugs tailproof found itself (``FOUND_HERE``).

Each entry states the bug in the project's vocabulary, names the vLLM code it touches and its
status against each supported release's source (checked by reading that source, not the PR
text). The entry's own fields are its vLLM 0.33 column; ``later`` lists what a later release
changed (``Bug.at`` gives the entry as of a release). A status is ``fixed`` (the fix is in the
release: ``mutants`` re-introduce it the way the PR diff describes and ``case`` kills them with
the corpus alone), ``present`` (the release still has it: ``finding`` names the detector that
reports it, ``conformance/tools/history/findings.py``) or ``not_applicable`` (``reason`` says
why no trace or mutant of that release can carry it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FIXED, PRESENT, NOT_APPLICABLE = "fixed", "present", "not_applicable"
STATUSES = (FIXED, PRESENT, NOT_APPLICABLE)
#: The releases the history has a column for, oldest first; an entry's own fields are the first.
RELEASES = ("0.33", "0.34")
#: ``Bug.listed`` of a bug tailproof found (not in issue 21, not yet reported upstream).
FOUND_HERE = "found by tailproof"


@dataclass(frozen=True)
class Later:
    """A bug's entry from ``release`` on, where it differs from the release before: the
    status with its evidence (the fields as in ``Bug``; the entry's others stay)."""

    release: str
    status: str
    reason: str
    mutants: tuple[str, ...] = ()
    case: str | None = None
    finding: str | None = None


@dataclass(frozen=True)
class Bug:
    ref: str  # "vllm#49502", "LMCache#4247"
    listed: str  # how the issue lists it: "fixed upstream" / "open upstream"
    statement: str  # two sentences in the project's vocabulary
    touches: str  # vLLM 0.33 module:function (or the outside component)
    status: str
    reason: str  # the source evidence for the status
    mutants: tuple[str, ...] = ()
    case: str | None = None  # corpus case named after the bug (kills the mutants)
    seed_case: str | None = None  # corpus case the named case was shrunk from
    finding: str | None = None  # detector id in findings.py (present bugs)
    avoided_by: str | None = None  # where TailproofConnector avoids it (test or case)
    output_only: str | None = None  # where it shows only in outputs (real-engine suite)
    later: tuple[Later, ...] = ()  # what later releases changed, oldest first

    @property
    def number(self) -> str:
        return self.ref.split("#", 1)[1]

    def at(self, release: str | None) -> Bug:
        """The entry as of ``release`` (None or an unknown one: the first release's): the
        last ``later`` change at or before it applied."""
        if release not in RELEASES:
            return self
        entry = self
        for change in self.later:
            if RELEASES.index(change.release) <= RELEASES.index(release):
                entry = replace(entry, status=change.status, reason=change.reason,
                                mutants=change.mutants, case=change.case,
                                finding=change.finding, seed_case=None)
        return entry


_MS = "distributed/kv_transfer/kv_connector/v1/mooncake/store"

BUGS: list[Bug] = [
    Bug("vllm#49502", "fixed upstream",
        "A producer that finishes right after its first sample (max_tokens=1) never offloads "
        "its partial tail: the producer marker became a hand-off only on a later CoW, which "
        "never comes, and free discarded it.",
        "v1/core/single_type_kv_cache_manager.py:MambaManager.finalize_partial_tail_offload "
        "(via KVCacheManager.finalize_partial_tail_offloads at finish)",
        FIXED, "0.33 consumes the marker at finish (finalize_tail) when the request ends "
        "at its boundary with nothing in flight and hands the exact table block to the "
        "connector (register_finished_partial_tail).",
        mutants=("m-49502-tail-only-on-cow",), case="hist_49502_max_tokens_1_tail_offloaded",
        seed_case="conn_finish_handoff_pinned_before_cleanup"),
    Bug("vllm#52832", "fixed upstream",
        "A producer finishing exactly at its registered tail boundary drops its final partial "
        "Mamba state: the store scheduler never queued a finish-time tail job. The fix pins "
        "the exact boundary block, queues the job and releases the pin when every worker is done.",
        f"{_MS}/scheduler.py:MooncakeStoreScheduler.register_finished_partial_tail",
        FIXED, "0.33's register_finished_partial_tail pins the finalized block and queues "
        "a store job for producers (kv_consumer excluded).",
        mutants=("ms-52832-no-finish-tail",), case="hist_52832_finish_at_boundary_tail_job",
        seed_case="conn_finish_handoff_pinned_before_cleanup"),
    Bug("vllm#51358", "fixed upstream",
        "The normal save resolved Mamba sources by position from the connector's append-only "
        "block-id mirror, so a null, freed or speculative Mamba block was put under a valid "
        "prefix hash (and write-once dedup kept the bad value: garbled output).",
        f"{_MS}/coordinator.py:MooncakeStoreCoordinator.store_mask (exclude_mamba) and the "
        "boundary-state hand-off path",
        FIXED, "0.33's store_mask passes exclude_mamba=True: Mamba groups are all-False in "
        "the normal save; Mamba state is stored only from exact hand-offs "
        "(boundary_state_offloads).",
        mutants=("mco-51358-positional-mamba-save",),
        case="hist_51358_mamba_never_saved_positionally",
        seed_case="cap_chat_fa16-m16-h4_mooncake",
        output_only="the poisoned state shows as garbled greedy output on a real engine; "
                    "the trace shows the positional Mamba put itself"),
    Bug("vllm#50359", "fixed upstream",
        "Store hit reconciliation reported a length one group has no object at: FA objects "
        "at 32/64 and Mamba at 32/48 gave 48 with FA's key@48 missing (not loadable); the PR "
        "answers 32.",
        f"{_MS}/worker.py:MooncakeStoreWorker._tail_key_boundaries (after "
        "MooncakeStoreCoordinator._find_hit_blocks)",
        FIXED, "fixed in 0.33 in another form: #50359 was closed unmerged (port #52272 open) "
        "and _find_hit_blocks still reports 48, but the worker's lookup then names, per "
        "group, the stored key that holds the hit's tail: FA's object at 64 (tails "
        "[[0, 64], [1, 48]]), whose block prefix covers tokens 32..48, so 48 is loadable.",
        mutants=("mw-50359-tail-key-at-hit",), case="hist_50359_store_hit_at_fa_tail_key"),
    Bug("vllm#51766", "fixed upstream",
        "After an external hit plus a partial-tail CoW, core and worker disagree on the live "
        "Mamba column: a request continuing in its externally loaded block was not marked "
        "allocated, so its later tail CoW was taken as a first allocation.",
        "v1/core/single_type_kv_cache_manager.py:MambaManager.allocate_new_blocks",
        FIXED, "0.33 adds the request to _allocated_block_reqs on the external-continuation "
        "return path (the PR thread is not in the search index; the rule is read from 0.33).",
        mutants=("m-51766-no-alloc-mark",), case="hist_51766_external_hit_running_cow",
        seed_case="cap_store_failures_fa16-m16-h4"),
    Bug("vllm#43559", "fixed upstream",
        "The EAGLE peek margin was given to the Mamba group, whose finder never drops a "
        "block, so the joint hit resumed Mamba ahead of the attention-verified prefix "
        "(regression test #48361).",
        "v1/core/kv_cache_coordinator.py:HybridKVCacheCoordinator.find_longest_cache_hit; "
        f"{_MS}/coordinator.py:MooncakeStoreCoordinator._find_hit_blocks",
        FIXED, "0.33 gates the margin with `not isinstance(spec, MambaSpec)` in both "
        "fixed points (the store copy cites #43559).",
        mutants=("co-43559-eagle-margin-on-mamba", "mco-43559-eagle-margin-on-mamba"),
        case="hist_43559_eagle_margin_not_on_mamba",
        seed_case="conn_eagle_mamba_store_lookup_no_margin",
        output_only="resuming from speculative state shows as an accuracy drop on a real engine"),
    Bug("vllm#46453", "fixed upstream",
        "Under memory pressure the per-group hits diverge (FA evicted, a deeper Mamba state "
        "kept); max() over them over-reported the local hit and an assert fired in "
        "update_state_after_alloc (fixes #48425, #50344).",
        "v1/core/kv_cache_manager.py:KVCacheManager.get_computed_blocks_for_connector",
        NOT_APPLICABLE, "fixed in 0.33 (a group hitting deeper than full attention falls "
        "back to the reconciled get_computed_blocks), but that path runs only for connectors "
        "with supports_divergent_local_hybrid_hits (NIXL, MoRIIO); the Mooncake store "
        "connector and the trace's lookup op use get_computed_blocks, so no corpus case can "
        "reach it and a mutant there would survive for a reason outside the suite's reach "
        "(not added)."),
    Bug("vllm#54360", "fixed upstream",
        "With MTP/DFlash, hybrid hits were zero for some prompt lengths: the lookup caps at "
        "P-1, the drafter rewinds one hash unit, and the tail state was published at the "
        "prompt's own boundary, which the rewound lookup never reaches (#52244's mechanism).",
        "v1/kv_cache_interface.py:get_mamba_prefill_checkpoint_position (drop_eagle_block)",
        FIXED, "0.33 moves the EAGLE checkpoint one hash unit down (ck = floor((P-1)/h)*h - h "
        "with drop_eagle_block), so the state sits where the rewound lookup lands. #52244 "
        "and #57616 (plain-MTP all-groups fallback) are still open upstream; the latter is "
        "outside the trace vocabulary (groups are marked eagle explicitly).",
        mutants=("ki-ck-eagle-no-drop",), case="hist_54360_eagle_checkpoint_one_unit_down",
        seed_case="conn_eagle_mamba_store_lookup_no_margin"),
    Bug("LMCache#4247", "fixed upstream",
        "Resuming from a local APC prefix extended by a deeper external tail (mixed sources) "
        "restored a Mamba state that does not match the local prefix: corrupted output.",
        "LMCache LMCacheMPConnector (outside vLLM 0.33)",
        NOT_APPLICABLE, "the fix (fail closed: 0 external tokens for recurrent groups when a "
        "local prefix would be extended) lives in LMCache, not in vLLM 0.33's code, so no "
        "mutant of vLLM can bring it back. vLLM's Mooncake path keeps local and remote tails "
        "apart (conn_remote_vs_local_tail).",
        output_only="corrupted text on a real engine with LMCache only"),
    Bug("Mooncake#2827", "fixed upstream",
        "A duplicate offload of the same key hit OBJECT_ALREADY_EXISTS in the SSD persist "
        "path, failed the whole batch and left master metadata pointing at unwritten data: "
        "another request's KV was served.",
        "Mooncake store C++ (file_storage.cpp; outside vLLM 0.33)",
        NOT_APPLICABLE, "the bug and its fix are in Mooncake's store, not in vLLM 0.33. "
        "vLLM's side of the same class (exists-dedup of boundary puts, a failed put stays "
        "absent) is mutated by mw-boundary-not-deduped and covered by "
        "conn_failed_boundary_put_stays_absent."),
    # --- reported open upstream -------------------------------------------------------------
    Bug("vllm#56615", "open upstream",
        "With the EAGLE block drop, attention lookup probes B+H then drops H while Mamba looks "
        "up B: a tail stored with FA and Mamba both at B is missed once HBM is evicted.",
        f"{_MS}/worker.py:KVCacheStoreSendingThread tail puts, MooncakeStoreWorker."
        "_tail_key_boundaries",
        FIXED, "0.33 already puts the FA tail up to the proof end B+H and the Mamba tail at B "
        "(conn_eagle_tail_puts_proof_margin: FA key 48, Mamba 44, consumer hit 44); "
        "mw-tail-key-skips-next mutates the proof-key search.",
        mutants=("mw-tail-key-skips-next",), case="hist_56615_eagle_tail_found_at_proof_key",
        seed_case="conn_eagle_tail_puts_proof_margin"),
    Bug("vllm#56972", "open upstream",
        "Decode-phase Mamba states are never stored: the store scheduler drops every boundary "
        "hand-off past prefill_end (and kv_consumer skips them all), so a continuation prompt "
        "stops hitting at the prompt end and save_decode_cache is a no-op for hybrids.",
        f"{_MS}/scheduler.py:MooncakeStoreScheduler._handle_boundary_state_offloads",
        PRESENT, "0.33 filters hand-offs with boundary > prefill_end_tokens and returns early "
        "for kv_consumer; the core offers the aligned decode snapshot (drain_offloads) and "
        "the connector creates no job.",
        case="hist_56972_decode_mamba_state_not_stored", finding="decode_boundary_dropped",
        avoided_by="tests/conformance/test_history.py::test_56972_side_by_side "
                   "(decode_boundary_saves, conn_x07_decode_boundary_saved)",
        later=(Later("0.34", FIXED,
                     "0.34 calls _handle_boundary_state_offloads when not is_consumer or "
                     "save_decode_cache, and with save_decode_cache keeps a boundary past "
                     "prefill_end_tokens (a consumer keeps only those); __init__ sets the "
                     "retention interval to the block size so the core offers them. "
                     "ms-034-56972-decode-checkpoint-dropped reverts the fix.",
                     mutants=("ms-034-56972-decode-checkpoint-dropped",),
                     case="hist_56972_decode_checkpoint_stored_v034"),)),
    Bug("vllm#56971", "open upstream",
        "Store keys ignore dtype, quantization and layout: an fp16 engine's blocks load into "
        "an fp8 or differently quantized engine under the same key.",
        f"{_MS}/data.py:PoolKey.build_prefix (KeyMetadata)",
        PRESENT, "0.33's KeyMetadata holds the model basename, ranks, group, cache_prefix "
        "and store_namespace only; PoolKey.build_prefix adds nothing else.",
        finding="keys_ignore_layout",
        avoided_by="tests/conformance/test_history.py::test_56971_side_by_side "
                   "(impl/fingerprint.py in every TailproofConnector key)",
        output_only="foreign bytes load silently: wrong text on a real engine"),
    Bug("vllm#45238", "open upstream",
        "The align checkpoint lands in request-unique tokens, so a request sharing only a "
        "prefix hits 0 with no warning.",
        "v1/core/sched/scheduler.py:Scheduler._mamba_block_aligned_split (junction stop); "
        "Request.shared_prefix_boundary",
        FIXED, "0.33 detects the shared-prefix junction at admission and stops a chunk there, "
        "block-floored (or exact with enable_mamba_shared_prefix_checkpoint + EAGLE): "
        "core_j01_junction_off_grid_flag_off resumes at 4 for a junction at 6. A shared "
        "prefix shorter than one Mamba block still floors to 0 (by design of the grid).",
        mutants=("sc-junction-block-ceil",), case="hist_45238_junction_stop_block_floored",
        seed_case="core_j01_junction_off_grid_flag_off"),
    Bug("vllm#56142", "open upstream",
        "With separate target and draft full-attention groups, the shared-prefix checkpoint "
        "(junction) is the longest single-group hit (96 for hits 96/80/80) instead of being "
        "bounded by every FA group's hit (80).",
        "v1/core/kv_cache_coordinator.py:HybridKVCacheCoordinator.find_longest_cache_hit "
        "(longest_hit_length -> num_uncached_common_prefix_tokens)",
        PRESENT, "0.33 takes longest_hit_length = max over every attention group's hit as the "
        "loop runs and returns longest - hit: B hits FA16 32, FA8 24 (its key at 32 evicted), "
        "Mamba 0, and its junction is 32. Two FA groups of different block sizes stand in for "
        "the target/draft pair (0.33's loop does not tell them apart).",
        case="hist_56142_shared_prefix_checkpoint_past_a_group",
        finding="junction_past_a_group"),
    Bug("vllm#49250", "open upstream",
        "The `recompute` preemption policy gives wrong output on Model Runner V2.",
        "v1/worker/gpu (Model Runner V2), outside the KV cache manager",
        NOT_APPLICABLE, "a model-runner bug: block ids and hits are unaffected, so no trace "
        "observation can differ.",
        output_only="greedy output differs on MRv2; the real-engine suite's concern"),
    Bug("vllm#45497", "open upstream",
        "Hybrid load-failure recovery unpacks a single group's block ids, so a block-level "
        "load failure on a multi-group model cannot be mapped back to requests.",
        "v1/core/sched/scheduler.py:Scheduler._update_requests_with_invalid_blocks / "
        "_handle_invalid_blocks",
        NOT_APPLICABLE, "0.33 still unpacks one group (`(req_block_ids,) = get_block_ids`) "
        "but _handle_invalid_blocks raises RuntimeError first for more than one group: it "
        "fails closed, and hybrid connectors (Mooncake) report failed_recving instead. "
        "Block-level invalid_block_ids are not a trace op."),
    Bug("vllm#53730", "open upstream",
        "Partial external loads under DCP leave group states mismatched (sharded attention vs "
        "replicated Mamba).",
        f"{_MS}/worker.py (DCP shard layout)",
        NOT_APPLICABLE, "needs decode-context parallelism (dcp > 1); traces model one DCP rank."),
    Bug("vllm#57596", "open upstream",
        "prompt_logprobs requests skip the connector hit but are still recorded as full "
        "external misses in the prefix-cache stats.",
        "v1/core/sched/scheduler.py (external prefix cache stats)",
        NOT_APPLICABLE, "a metrics bug: traces do not carry skip_reading_prefix_cache "
        "requests or the stats counters."),
    # --- found by tailproof (docs/triage.md), not yet reported upstream ------------------------
    Bug("tailproof#forced-preemption", FOUND_HERE,
        "Scheduler.reset_prefix_cache(reset_running_requests=True) preempts the running "
        "requests outside schedule(); the next schedule() re-admits them and reports them "
        "preempted in the same SchedulerOutput, and MooncakeStoreScheduler.build_connector_meta "
        "drops a preempted request's state before it handles the step's admissions: an "
        "asynchronous load is never issued (the request waits in WAITING_FOR_REMOTE_KVS "
        "forever), and a synchronous re-admission finds no state to resume from.",
        "v1/core/sched/scheduler.py:Scheduler.reset_prefix_cache; "
        f"{_MS}/scheduler.py:MooncakeStoreScheduler.build_connector_meta",
        PRESENT, "0.33 pops the preempted request's load spec and resets its tracker first "
        "(the async load is lost: a hang); a synchronous re-admission then raises, TypeError "
        "in the resumed branch under Model Runner V1 (request_tuple is None) and the "
        "_unfinished_requests assert under Model Runner V2 (a resumed request is a new one).",
        finding="forced_preemption_stalls",
        avoided_by="tests/impl/test_vllm_scheduler.py::test_reset_with_running_requests_"
                   "finishes_them (TailproofConnector's re-admission rule, "
                   "impl/scheduler_side.py)",
        later=(Later("0.34", PRESENT,
                     "0.34's build_connector_meta still pops the preempted request's load spec "
                     "and tracker first (the async load is lost: a hang), and with every "
                     "resumed request now a new one, a synchronous re-admission fails the "
                     "_unfinished_requests assert under every model runner (the crash "
                     "variant).", finding="forced_preemption_stalls"),)),
]


def by_ref(ref: str) -> Bug:
    """The entry for ``ref`` ("vllm#49502", or the bare number)."""
    for b in BUGS:
        if ref in (b.ref, b.number):
            return b
    raise KeyError(ref)
