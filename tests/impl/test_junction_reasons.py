"""Junction checkpoints that resolve on but do not act: each skip is counted by reason and
said once (``JunctionCheckpoints.skipped``); vLLM's own junction where it keys no Mamba
state (no EAGLE group, the issue's agent workload) is taken, not skipped."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.extension import ReuseExtension
from tailproof.impl.junctions import JunctionCheckpoints
from tailproof.impl.scheduler_side import SchedulerSide

H = 16


def _side(fa_block: int = 16) -> SchedulerSide:
    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(fa_block, 64),
                        is_mamba=(False, True), hash_block_size=H, scheduler_block_size=64,
                        partial_hits=True, use_eagle=False, num_blocks=64)
    side = SchedulerSide(Settings(junction_checkpoints=True), geo, None, 1)
    # what the hook records without EAGLE or device keys
    side.ext.junction_hook_ran(vllm_keys_junctions=False)
    return side


def _jn(side: SchedulerSide) -> JunctionCheckpoints:
    """The scheduler side's junction part (its extension collaborator's)."""
    assert isinstance(side.ext, ReuseExtension) and side.ext.junctions is not None
    return side.ext.junctions


def _req(rid: str, shared: int, spb: int = 0) -> SimpleNamespace:
    """A 160-token prompt sharing its first ``shared`` blocks with request "a"."""
    hashes = [bytes([i]) * 4 for i in range(shared)]
    hashes += [rid.encode() + bytes([i]) for i in range(shared, 10)]
    return SimpleNamespace(request_id=rid, num_prompt_tokens=160, block_hashes=hashes,
                           shared_prefix_boundary=spb)


def test_each_skip_is_counted_by_reason_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    side = _side()
    total = side.metrics.c.total
    _jn(side).at_lookup(_req("a", 10), 0)  # first prompt: nothing shared, nothing counted
    b = _req("b", 3)
    _jn(side).at_lookup(b, 0)  # junction 48, off the Mamba grid (64): a stop is set
    assert total("junctions_set") == 1 and b.shared_prefix_boundary == 48
    _jn(side).vllm_keys_junctions = True  # an EAGLE group: vLLM keys its own junction itself
    with caplog.at_level(logging.INFO, logger="tailproof.impl.junctions"):
        _jn(side).at_lookup(_req("d", 3, spb=48), 0)
        _jn(side).at_lookup(_req("d2", 3, spb=48), 0)
    assert total("junctions_skipped_vllm_junction") == 2
    assert caplog.text.count("vLLM marks and stores this junction itself") == 1  # said once
    assert "d" not in _jn(side).targets
    _jn(side).vllm_keys_junctions = False  # no EAGLE group: vLLM stops there but keys no state
    c = _req("c", 3, spb=48)
    _jn(side).at_lookup(c, 0)
    assert _jn(side).targets["c"] == 48 and c.shared_prefix_boundary == 48
    assert total("junctions_set_at_vllm_junction") == 1 and total("junctions_set") == 2
    _jn(side).at_lookup(_req("e", 4), 0)  # 64: vLLM hands off the aligned state
    assert total("junctions_skipped_aligned") == 1
    _jn(side).at_lookup(_req("f", 3), 48)  # the hit already reaches the junction
    assert total("junctions_skipped_served") == 1
    _jn(side).at_lookup(_req("g", 3, spb=80), 0)  # vLLM stops the chunk later itself
    assert total("junctions_skipped_vllm_junction_later") == 1
    _jn(side).exact_stops = False
    _jn(side).at_lookup(_req("h", 3), 0)
    assert total("junctions_skipped_no_hook") == 1
    assert total("junctions_set") == 2


@pytest.mark.parametrize("fa_block, job", [(16, False), (32, True)])
def test_device_keyed_junction_takes_a_job_only_off_the_attention_grid(
        fa_block: int, job: bool) -> None:
    """With the managers keying junctions (``device_junctions``) the connector's own junction
    still gets its stop; the junction job only where the hand-off lacks attention KV up to it
    (48 is on FA 16's grid, off FA 32's)."""
    side = _side(fa_block)
    _jn(side).vllm_keys_junctions = True
    _jn(side).at_lookup(_req("a", 10), 0)
    b = _req("b", 3)
    _jn(side).at_lookup(b, 0)
    assert b.shared_prefix_boundary == 48 and side.metrics.c.total("junctions_set") == 1
    assert ("b" in _jn(side).targets) is job
    assert side.metrics.c.total("junctions_set_device_keyed") == (0 if job else 1)


@pytest.mark.vllm
def test_hook_reads_whether_vllm_keys_its_junction() -> None:
    """On the real Scheduler without an EAGLE group vLLM keys no state at its own junction:
    the hook records it, so the connector takes such junctions itself (extension rule 2)."""
    pytest.importorskip("vllm")
    from engine_sim import Engine

    e = Engine({"store": "memory", "namespace": "jn-reasons", "junction_checkpoints": True},
               num_blocks=96, groups=(("full_attention", 16), ("mamba", 16)), h=4,
               max_batched=64)
    side = e.conn.scheduler_side
    assert _jn(side).exact_stops
    assert _jn(side).vllm_keys_junctions is False
    assert not e.sched.kv_cache_manager.mamba_shared_prefix_checkpoint
    e.shutdown()


def test_a_stop_the_chunk_ran_past_is_counted_and_spent() -> None:
    """A junction stop whose chunk ended past it (vLLM re-assigned the request's junction) is
    spent and counted (``junctions_skipped_stop_missed``); one not reached yet stays."""
    from tailproof.impl.meta import TailproofMeta

    side = _side()
    _jn(side).at_lookup(_req("a", 10), 0)
    _jn(side).at_lookup(_req("b", 3), 0)
    meta = TailproofMeta(preempted_req_ids=set(), finished_req_ids=set())
    _jn(side).jobs({"b": 32}, None, meta, {})
    assert _jn(side).targets == {"b": 48}
    _jn(side).jobs({"b": 64}, None, meta, {})
    assert not _jn(side).targets and not meta.stores and not meta.snapshots
    assert side.metrics.c.total("junctions_skipped_stop_missed") == 1


@pytest.mark.vllm
def test_hook_sets_both_junction_keying_flags_with_device_junctions() -> None:
    """``device_junctions``: the hook sets ``KVCacheManager.mamba_shared_prefix_checkpoint``
    and every ``MambaManager.shared_prefix_checkpoint`` (the two must agree), so the
    connector stands down where vLLM now keys the junction state itself."""
    pytest.importorskip("vllm")
    from engine_sim import Engine
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    e = Engine({"store": "memory", "namespace": "jn-device", "junction_checkpoints": True,
                "device_junctions": True},
               num_blocks=96, groups=(("full_attention", 16), ("mamba", 16)), h=4,
               max_batched=64)
    kvm = e.sched.kv_cache_manager
    mamba = [m for m in kvm.coordinator.single_type_managers if isinstance(m, MambaManager)]
    assert _jn(e.conn.scheduler_side).vllm_keys_junctions is True
    assert kvm.mamba_shared_prefix_checkpoint and mamba
    assert all(m.shared_prefix_checkpoint for m in mamba)
    e.shutdown()
