"""Seeded mutants of the reuse extension in ``tailproof.impl``: turn-end checkpoints
(``docs/reuse.md``, ``te-*``) and junction checkpoints (``docs/junctions.md``, ``jn-*``).

The vLLM catalog (``catalog.py``) mutates vLLM 0.33 and is scored on the vLLM adapters; the
extension is not in vLLM, so its mutants target our own connector and are killed by the
extension cases (``conformance/cases/conn_x*.json``) replayed on ``reference,impl`` with strict
ids: an observation that differs from the reference, or a ``KVByteMismatch`` (a put or a load
whose bytes are not the KV of its prefix, checked by ``runner_sim``).

    from tailproof.conformance.tools.mutate.impl_extension import MUTANTS, score
    score()  # {mutant id: (killed, first killing case, op index, op)}

Each mutant is applied in memory (``apply.mutated_source``) and undone after its run.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

from tailproof.conformance.format.connector_config import extension_on
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.replay import run_trace
from tailproof.conformance.tools.mutate.apply import apply_mutant, mutated_source
from tailproof.conformance.tools.mutate.catalog import Mutant

SS = "tailproof.impl.scheduler_side"
TE = "tailproof.impl.turn_end"
JN = "tailproof.impl.junctions"
WS = "tailproof.impl.worker_side"
ADAPTERS = ["reference", "impl"]

MUTANTS: list[Mutant] = [
    Mutant("te-wrong-boundary", TE, "checkpoint_draft",
           "puts += [BoundaryPut(g, slot, b) for g, slot",
           "puts += [BoundaryPut(g, slot, b - geo.hash_block_size) for g, slot",
           "the flush keys the snapshot one hash block below its content's boundary: the "
           "state of the prefix b is stored under the key of b - h"),
    Mutant("te-snapshot-one-step-late", TE, "step_ends",
           "out[rid] = computed + sched[rid] - len(drafts.get(rid, ()))",
           "out[rid] = computed",
           "the snapshot is due on the computed tokens at schedule time, so it is taken in "
           "the step after the one ending on the boundary: the copy (after that step's "
           "forward) holds the state one token past the boundary it is keyed at"),
    Mutant("te-slot-pin-released-early", SS, "SchedulerSide.seal",
           "ids = [p.block_id for p in puts]",
           "ids = [p.block_id for p in puts if budgeted or not self.geo.is_mamba[p.group_id]]",
           "the flush job does not pin the slots, so dropping the connector's reference at "
           "finish frees them before the workers read them (I14)"),
    Mutant("te-lookup-wait-never-released", SS, "SchedulerSide.update_connector_output",
           "self.ext.job_released(job)", "pass",
           "rule 7: a released job's keys are never forgotten, so a lookup extending them "
           "waits forever (the turn is never admitted)"),
    Mutant("te-snapshot-copy-skipped", WS, "WorkerSide.copy_snapshots",
           "n += self.layout.copy_block(snap.group, snap.src_block, snap.slot_block)",
           "n += 0",
           "the worker never copies the running state into the slot: every scheduler "
           "observation is unchanged, only the bytes the flush puts are wrong"),
    Mutant("jn-wrong-boundary", JN, "JunctionCheckpoints.jobs",
           "self.turn_end.checkpoint_job(req, slots, n, ids,",
           "self.turn_end.checkpoint_job(req, slots, n - geo.hash_block_size, ids,",
           "the junction job keys the copied state one hash block below the junction: the "
           "state of the prefix J is stored under the key of J - h"),
    Mutant("jn-snapshot-not-copied", JN, "JunctionCheckpoints.jobs",
           "zip(self.mamba_groups, srcs, slots, strict=True)]",
           "() and zip(self.mamba_groups, srcs, slots, strict=True)]",
           "the junction job takes fresh blocks and puts them but asks no worker to copy the "
           "running state into them: the store gets whatever the blocks held"),
    Mutant("jn-copy-unpinned", JN, "JunctionCheckpoints.jobs",
           "pool.free_blocks([blocks[b] for b in slots])",
           "pool.free_blocks([blocks[b] for b in slots * 2])",
           "the junction job's copies are released twice, the job's pin with the connector's "
           "reference, so a later allocation can take them before the workers read them"),
    Mutant("jn-stop-on-grid", JN, "JunctionCheckpoints.at_lookup",
           "if all(j % geo.block_sizes[g] == 0 for g in self.mamba_groups):",
           "if False:",
           "a junction on every Mamba block grid still stops the chunk and gets a job (its "
           "aligned state is handed off and stored anyway): a needless stop and copy"),
    Mutant("jn-unkeyed-vllm-junction-skipped", JN, "JunctionCheckpoints.at_lookup",
           "if j == spb and self.vllm_keys_junctions:", "if j == spb:",
           "vLLM's own junction is skipped even where MambaManager keys no state there (no "
           "EAGLE group): the chunk stops at it and the state is lost, so every later "
           "request sharing the prefix recomputes it (issue 22's agent workload)"),
    Mutant("jn-device-keys-manager-unset", JN, "key_device_junctions",
           "manager.shared_prefix_checkpoint = True",
           "manager.shared_prefix_checkpoint = False",
           "device_junctions sets the KVCacheManager's flag but not the MambaManagers': the "
           "split stops at the junction and the connector stands down, yet nothing keys the "
           "state there (the disagreement KVCacheManager.__init__ warns of)"),
    Mutant("jn-device-keyed-off-attention-grid", JN, "JunctionCheckpoints.at_lookup",
           "if self.vllm_keys_junctions and all(",
           "if self.vllm_keys_junctions or all(",
           "with device_junctions the connector skips the junction job at a junction off the "
           "attention grid too: the hand-off stores the Mamba state but no attention KV up to "
           "it, so a later request's store hit stops at the attention block below"),
]


@contextlib.contextmanager
def applied(m: Mutant) -> Iterator[None]:
    """``m`` applied in this process for the duration of the block, then undone by rebinding
    the original: where it lived, and in every module that imported a module-level function
    by name (``apply_mutant`` rebinds those too)."""
    owner, attr, raw, _ = mutated_source(m)
    apply_mutant(m)
    new = vars(owner)[attr]
    rebound = [] if inspect.isclass(owner) else [
        (d, name) for mod in list(sys.modules.values())
        if (d := getattr(mod, "__dict__", None)) is not None and mod is not owner
        for name, value in list(d.items()) if value is new]
    try:
        yield
    finally:
        setattr(owner, attr, raw)
        for d, name in rebound:
            d[name] = raw


def extension_cases() -> list[Any]:
    """The extension cases of the corpus (their config turns the extension on)."""

    traces = [load_trace(p) for p in corpus_paths() if p.name.startswith("conn_")]
    return [t for t in traces if extension_on(t.config.connector)]


def first_kill(traces: list[Any]) -> tuple[str, int, str] | None:
    """The first divergence of ``traces`` on reference vs impl (strict ids), as (case, op
    index, op), or None when every case agrees."""
    for t in traces:
        r = run_trace(t, ADAPTERS, strict=True)
        if r.divergences:
            d = r.divergences[0]
            return d.case, d.op_index, d.op
    return None


def score(mutants: list[Mutant] | None = None) -> dict[str, tuple[str, int, str] | None]:
    """Per mutant, the first extension case (and op) that kills it, or None (survived)."""
    traces = extension_cases()
    out: dict[str, tuple[str, int, str] | None] = {}
    for m in mutants or MUTANTS:
        with applied(m):
            out[m.id] = first_kill(traces)
    return out
