"""The junction extension's parts: the prompt-hash index and the scheduler hook plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tailproof.impl.junctions import JunctionIndex


def _chain(tokens: list[int], h: int) -> list[bytes]:
    """Chained block hashes like vLLM's: block k names the prefix (k + 1) * h."""
    out, prev = [], b"root"
    for k in range(len(tokens) // h):
        prev = repr((prev, tuple(tokens[k * h:(k + 1) * h]))).encode()
        out.append(prev)
    return out


def test_known_prefix_is_the_longest_shared_prefix() -> None:
    idx = JunctionIndex(1000)
    a = list(range(100))
    b = a[:64] + [999] * 36
    idx.add(_chain(a, 4), 25)
    assert idx.known_prefix_blocks(_chain(b, 4), 25) == 16  # 64 tokens shared, h = 4
    assert idx.known_prefix_blocks(_chain(a, 4), 10) == 10  # capped by the limit
    assert idx.known_prefix_blocks(_chain([7] * 40, 4), 10) == 0


def test_only_indexed_blocks_count() -> None:
    idx = JunctionIndex(1000)
    a = list(range(100))
    idx.add(_chain(a, 4), 5)  # only the first 5 blocks of a are indexed
    assert idx.known_prefix_blocks(_chain(a, 4), 25) == 5


def test_capacity_evicts_least_recent_and_never_overstates() -> None:
    idx = JunctionIndex(8)
    old, new = list(range(40)), list(range(100, 140))
    idx.add(_chain(old, 4), 10)
    idx.add(_chain(new, 4), 10)
    assert len(idx) == 8
    assert idx.known_prefix_blocks(_chain(new, 4), 10) == 8  # its first blocks stay
    assert idx.known_prefix_blocks(_chain(old, 4), 10) == 0
    with pytest.raises(ValueError, match="capacity"):
        JunctionIndex(0)


def test_both_plugins_patch_the_scheduler_whatever_the_order() -> None:
    """The recorder and the junction hook share one chained import hook: registered in either
    order before vLLM's scheduler is imported, both patches land."""
    for order in ("recorder, junctions", "junctions, recorder"):
        regs = {"recorder": "tailproof.conformance.capture.plugin",
                "junctions": "tailproof.impl.vllm_plugin"}
        code = "import importlib\n"
        for name in order.split(", "):
            code += f"importlib.import_module({regs[name]!r}).register()\n"
        code += ("from vllm.v1.core.sched.scheduler import Scheduler as S\n"
                 "print(getattr(S, '_tailproof_recorder_patched', False), "
                 "getattr(S, '_tailproof_scheduler_hook', False))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.split()[-2:] == ["True", "True"], (order, out.stdout, out.stderr)


# --------------------------------------------------------------------------- engine (vLLM 0.33)

vllm_only = pytest.mark.vllm


def _engine(extra: dict, name: str, block: int = 16) -> object:
    pytest.importorskip("vllm")
    from engine_sim import Engine

    return Engine({"store": "memory", "namespace": f"jn-{name}", "capacity_bytes": 1 << 26,
                   **extra}, num_blocks=96, groups=(("full_attention", block), ("mamba", block)),
                  h=4, max_batched=64)




def _first_hits(e: object, prompts: dict[str, list[int]], steps: int = 200) -> dict[str, int]:
    """Add every prompt, run to the end; each request's computed tokens at its first step."""
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=2)
    hits: dict[str, int] = {}
    reqs = dict(e.sched.requests)
    for _ in range(steps):
        if not e.sched.has_requests() and not e.conn.has_pending_push_work():
            break
        log = e.step()
        assert log.byte_errors == []
        for rid, n in log.scheduled.items():
            hits.setdefault(rid, reqs[rid].num_computed_tokens - n)
        for rid, req in reqs.items():  # a load completes without a scheduled step
            if rid not in hits and req.num_computed_tokens:
                hits[rid] = req.num_computed_tokens
    return hits


@vllm_only
def test_junction_state_stored_and_reused_byte_exact() -> None:
    """Prompts sharing 28 tokens (off the Mamba grid of 16): the second stops its chunk at 28,
    a junction job stores the state there with the attention KV, and the later ones resume at
    28 from the store (every loaded byte checked); pins and snapshot blocks all released."""
    shared = list(range(10, 38))  # 28 tokens
    prompts = {f"c{i}": shared + [100 + 10 * i + k for k in range(12)] for i in range(4)}
    e = _engine({"junction_checkpoints": True}, "reuse")
    e.add("c0", prompts["c0"], max_tokens=2)
    e.run(50)
    e.add("c1", prompts["c1"], max_tokens=2)
    e.step()
    assert e.sched.requests["c1"].num_computed_tokens == 28  # the chunk stopped at the junction
    e.run(50)
    side = e.conn.scheduler_side
    assert side.metrics.c.total("junctions_set") == 1
    assert side.metrics.c.total("junction_jobs") == 1
    hits = _first_hits(e, {"c2": prompts["c2"]})
    assert hits["c2"] == 28
    assert side.held == {} and e.refcounts() == {}
    e.shutdown()


@vllm_only
def test_no_hook_no_junction(caplog: pytest.LogCaptureFixture) -> None:
    """Without the scheduler hook the stop could not be exact: no junction is set, one warning."""
    shared = list(range(10, 38))
    e = _engine({"junction_checkpoints": True}, "nohook")
    e.conn.scheduler_side.ext.junctions.exact_stops = False
    e.add("c0", shared + [1] * 12, max_tokens=2)
    e.run(50)
    e.add("c1", shared + [2] * 12, max_tokens=2)
    with caplog.at_level("WARNING"):
        e.run(50)
    assert e.conn.scheduler_side.metrics.c.total("junctions_set") == 0
    assert "scheduler hook did not run" in caplog.text
    e.shutdown()


@vllm_only
def test_hook_refuses_other_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    e = _engine({"junction_checkpoints": True}, "version")
    assert e.sched.mamba_shared_prefix_checkpoint
    side = e.conn.scheduler_side
    side.ext.junctions.exact_stops = False
    e.sched.mamba_shared_prefix_checkpoint = False
    monkeypatch.setattr(vllm, "__version__", "0.35.0")  # names not checked against it
    e.conn.on_scheduler_built(e.sched)
    assert not side.ext.junctions.exact_stops and not e.sched.mamba_shared_prefix_checkpoint
    for checked in ("0.33.0", "0.34.0"):  # vllm_release.JUNCTION_HOOK_RELEASES
        monkeypatch.setattr(vllm, "__version__", checked)
        e.conn.on_scheduler_built(e.sched)
        assert side.ext.junctions.exact_stops and e.sched.mamba_shared_prefix_checkpoint
        side.ext.junctions.exact_stops = False
        e.sched.mamba_shared_prefix_checkpoint = False
    e.shutdown()


@vllm_only
def test_hook_is_a_no_op_when_off() -> None:
    e = _engine({"junction_checkpoints": False}, "off")
    assert not e.sched.mamba_shared_prefix_checkpoint
    assert e.conn.scheduler_side.ext.junction_stops() == {}
    assert type(e.conn.scheduler_side.ext).__name__ == "NoExtension"
    e.shutdown()


@vllm_only
def test_auto_turns_every_part_on_here() -> None:
    """"auto": a hybrid engine with partial hash hits and no speculative decoding gets every
    part of the extension, the exact junction stop included."""
    e = _engine({k: "auto" for k in ("turn_end_checkpoints", "decode_boundary_saves",
                                     "junction_checkpoints")}, "auto")
    s = e.conn.settings
    assert s.turn_end_checkpoints and s.decode_boundary_saves and s.junction_checkpoints
    assert e.sched.mamba_shared_prefix_checkpoint
    e.shutdown()


@vllm_only
def test_next_turn_sent_at_finish_finds_the_turn_end() -> None:
    """Rule 3b: a request finishing by length is flushed at its last boundary before it ends,
    so a next turn added in the step right after the finish already resumes there."""
    e = _engine({"turn_end_checkpoints": True}, "eager", block=64)  # the device keeps only 44
    prompt = list(range(10, 55))  # 45 tokens, ck = 44
    r1 = e.add("t1", prompt, max_tokens=18)  # finishes having computed 62: last boundary 60
    for _ in range(100):
        log = e.step()
        if "t1" in log.finished:
            break
    e.add("t2", list(r1.all_token_ids) + [7] * 10, max_tokens=1)
    logs = e.run(100)
    loads = [(j.vllm_cached_tokens, j.kvpool_cached_tokens) for lg in logs for j in lg.loads]
    assert loads and loads[0][1] == 60, loads
    assert [x for lg in e.log for x in lg.byte_errors] == []
    e.shutdown()
