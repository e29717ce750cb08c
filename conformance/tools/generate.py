"""Random valid core traces for property-based differential testing (hypothesis).

A trace is built step by step (``steps.py``) while every adapter runs it in lockstep
(``lockstep.py``), so each next op can follow the scheduler's rules (decode only after
prefill, commit only what was allocated). Draws are biased toward what breaks partial-tail
caching: shared prefixes, sub-block prompts, prompts ending exactly on a block or hash
boundary, prompts shorter than h, and pool pressure. On the first diverging op the trace so
far is raised as a ``LockstepDivergence`` and can be written as a trace file ready to join
the corpus (hypothesis shrinks it first).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tailproof.conformance.harness.lockstep import Lockstep, LockstepDivergence
from tailproof.conformance.harness.releases import installed_release
from tailproof.conformance.harness.steps import Steps, op
from tailproof.reference.releases import DEFAULT as DEFAULT_RELEASE

__all__ = ["GEOMETRIES", "LockstepDivergence", "lockstep_trace", "write_case"]

FA, M, SW = "full_attention", "mamba_align", "sliding_window"
Geometry = tuple[list[tuple[str, int, bool]], int, bool]  # (groups, h, use_eagle)

# The corpus's geometries and a few more shapes vLLM accepts.
GEOMETRIES: list[Geometry] = [
    ([(FA, 2, False), (M, 4, False)], 2, False),
    ([(FA, 4, False), (M, 4, False)], 2, False),
    ([(FA, 4, False), (M, 16, False)], 4, False),
    ([(FA, 16, False), (M, 16, False)], 4, False),
    # Sliding-window groups (window = block + 1, geometry_config): partial hits off (block
    # != h) with EAGLE on the window, and on (block == h).
    ([(FA, 16, False), (SW, 16, True), (M, 64, False)], 8, True),
    ([(FA, 4, False), (SW, 4, False), (M, 16, False)], 4, False),
    ([(FA, 16, True), (M, 16, False)], 4, True),
    ([(FA, 8, False), (M, 8, False), (M, 8, False)], 4, False),
    ([(FA, 8, False), (M, 8, False)], 8, False),  # partial hits off
    ([(FA, 4, True), (M, 8, False)], 2, True),
    ([(FA, 16, True), (M, 64, False)], 16, True),
    ([(FA, 4, False), (M, 12, False)], 2, False),  # lcm 12
    ([(FA, 6, False), (M, 4, False)], 2, False),  # lcm 12, attention block larger
    ([(FA, 4, False), (FA, 4, False), (M, 8, False)], 2, False),
    ([(FA, 4, False), (FA, 8, False)], 4, False),  # attention only, two block sizes
    ([(FA, 4, False)], 4, False),  # one group: the unitary coordinator
    ([(M, 8, False)], 8, False),  # Mamba only
    # Shapes the mutation kit found unreached (docs/mutation.md):
    ([(FA, 16, False), (M, 8, False)], 8, False),  # h = Mamba block < lcm: lcm-aligned hits
    ([(FA, 8, False), (M, 8, False)], 4, True),  # EAGLE, no group flagged: every group EAGLE
    ([(FA, 4, False), (FA, 8, False), (M, 8, False)], 4, False),  # 3 spec groups: fixed point
    ([(FA, 4, True), (FA, 8, False), (M, 8, False)], 4, True),  # EAGLE on one of two FA groups
    ([(FA, 16, True), (M, 16, False)], 16, True),  # EAGLE with partial hits off
    ([(FA, 8, False), (M, 8, False), (M, 16, False)], 4, False),  # Mamba groups of two sizes
    ([(FA, 4, False), (M, 8, False), (M, 16, False)], 4, True),  # ... with every group EAGLE
]
ACTIONS = ["add", "add", "admit", "admit", "admit", "finish", "preempt", "evict", "pool_state"]


def with_junction_checkpoint(geometry: Geometry) -> Geometry:
    """The geometry with EAGLE flagged on its Mamba groups, so that
    ``enable_mamba_shared_prefix_checkpoint`` takes effect where partial hits are on
    (``KVCacheManager`` narrows the flag to configurations with an EAGLE group)."""
    groups, h, eagle = geometry
    return [(k, b, e or k == M) for k, b, e in groups], h, eagle


def geometry_config(geometry: Geometry, num_blocks: int, **settings: Any) -> dict[str, Any]:
    """The trace config of a geometry. The generators run the reference beside the installed
    vLLM, so a trace names the installed release when it is not the default one (``config.vllm``,
    docs/releases.md)."""
    groups, h, eagle = geometry
    release = installed_release()
    named = {"vllm": release} if release not in (None, DEFAULT_RELEASE) else {}
    return {"groups": [{"kind": k, "block_size": b, **({"eagle": True} if e else {}),
                        **({"sliding_window": b + 1} if k == SW else {})}
                       for k, b, e in groups],
            "hash_block_size": h, "num_blocks": num_blocks, "use_eagle": eagle, **named,
            **settings}


def prompt_tokens(draw: st.DrawFn, h: int, block: int, prompts: dict[str, list[int]],
                  shapes: list[str], vocab: int, near_full: bool) -> list[Any]:
    """A prompt biased toward the shapes that matter for partial tails, with token ids up to
    ``vocab``; a "shared" prompt starts with a prefix of an earlier one (``prompt_of``), with
    ``near_full`` often the whole prompt or one or h tokens short of it."""
    shape = draw(st.sampled_from(shapes))
    if shape == "short":
        n = draw(st.integers(1, max(1, h - 1)))
    elif shape == "sub_block":
        n = draw(st.integers(h, max(h, block - 1)))
    elif shape in ("block_edge", "edge"):
        n = block * draw(st.integers(1, 3)) + draw(st.sampled_from([-1, 0, 1]))
    elif shape == "hash_edge":
        n = h * draw(st.integers(1, 3 * block // h)) + draw(st.sampled_from([0, 1]))
    else:
        n = draw(st.integers(1, 3 * block + h))
    n = max(1, n)
    if shape == "shared" and prompts:
        return _shared_prompt(draw, h, n, prompts, near_full)
    return [draw(st.integers(0, vocab)) for _ in range(n)]


def _shared_prompt(draw: st.DrawFn, h: int, n: int, prompts: dict[str, list[int]],
                   near_full: bool) -> list[Any]:
    src = draw(st.sampled_from(sorted(prompts)))
    full = len(prompts[src])
    if near_full:
        keep = draw(st.sampled_from([full, full, max(1, full - 1), max(1, full - h)])
                    | st.integers(1, full))
    else:
        keep = draw(st.one_of(st.just(full), st.integers(1, full)))
    extra = max(0, n - keep)
    return [{"prompt_of": src, "n": keep}] + [
        draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, max(extra, 2))))]


class _CoreScript:
    """The generator's scheduler: which requests wait and run, and what each step does."""

    def __init__(self, draw: st.DrawFn, run: Lockstep, geometry: Geometry) -> None:
        self.draw, self.run = draw, run
        self.steps = Steps(run.apply)
        self.num_groups, self.h = len(geometry[0]), geometry[1]
        self.biggest = max(b for _, b, _ in geometry[0])
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.loading: list[str] = []  # asynchronous loads not landed yet

    def step(self) -> None:
        """Landed asynchronous loads, then running requests, as ``Scheduler.schedule`` does,
        then up to three other actions (arrivals, admissions, finishes, preemptions,
        evictions), then the drains."""
        self.steps.begin()
        for rid in list(self.loading):
            if self.draw(st.booleans()):
                self.run.apply(op("remote_kv_ready", rid=rid))
                self.loading.remove(rid)
                self.running.append(rid)
        for rid in list(self.running):
            self.continue_running(rid)
        for _ in range(self.draw(st.integers(0, 3))):
            getattr(self, self.draw(st.sampled_from(ACTIONS)))()
        self.steps.drain()

    def continue_running(self, rid: str) -> None:
        """A prefill chunk, or a decode token once the prompt is done (sometimes skipped, as
        under a tight token budget)."""
        draw = self.draw
        if not draw(st.sampled_from([True, True, True, False])):
            return
        view = self.run.request(rid)
        if view.num_computed_tokens >= view.num_tokens:
            if not draw(st.booleans()):
                return
            self.run.apply(op("append_output", rid=rid, tokens=[draw(st.integers(0, 5))]))
            drafts = draw(st.sampled_from([0, 0, 1, 2, 3]))
            if drafts:
                self.decode_with_drafts(rid, drafts)
                return
        if self.steps.run(rid):
            self.steps.commit(rid)

    def decode_with_drafts(self, rid: str, drafts: int) -> None:
        """A decode step that verifies ``drafts`` speculative tokens: scheduled with the real
        one (``plan_chunk drafts``), counted as computed (``commit``), the rejected ones taken
        back (``rollback``) and the accepted ones plus the bonus token appended, as
        ``Scheduler.update_from_output`` does."""
        draw = self.draw
        view = self.run.request(rid)
        real = view.num_tokens - view.num_computed_tokens
        plan = self.run.apply(op("plan_chunk", rid=rid, drafts=drafts))
        if not plan or not plan.get("chunk"):
            return
        if not (self.run.apply(op("allocate", rid=rid, n="plan")) or {}).get("ok"):
            return
        self.steps.commit(rid)
        scheduled = max(0, plan["chunk"] - real)
        rejected = draw(st.integers(0, scheduled))
        self.run.apply(op("rollback", rid=rid, n=rejected))
        if plan["chunk"] >= real:
            self.run.apply(op("append_output", rid=rid, tokens=[
                draw(st.integers(0, 5)) for _ in range(scheduled - rejected + 1)]))

    def add(self) -> None:
        if len(self.run.prompts) < 8:
            rid = f"r{len(self.run.prompts)}"
            tokens = prompt_tokens(self.draw, self.h, self.biggest, self.run.prompts,
                                   ["shared", "shared", "sub_block", "block_edge", "short",
                                    "hash_edge", "random"], 5, near_full=True)
            self.run.apply(op("add_request", rid=rid, tokens=tokens))
            self.waiting.append(rid)

    def admit(self) -> None:
        """Admit a waiting request; sometimes a connector supplies more tokens than the
        local hit (external)."""
        if not self.waiting:
            return
        rid = self.draw(st.sampled_from(self.waiting))
        hit, _ = self.steps.lookup(rid)
        view = self.run.request(rid)
        room = max(0, view.num_tokens - view.num_computed_tokens - hit - 1)
        ext = self.draw(st.sampled_from([0, 0, 0, room // 2, room])) if room else 0
        if ext and self.draw(st.integers(0, 2)) == 0:
            # An asynchronous load: blocks for the hit and the external tokens, nothing
            # scheduled, nothing cached until it lands (remote_kv_ready).
            obs = self.run.apply(op("allocate", rid=rid, n=0, use_hit=True, external=ext,
                                    delay_cache=True))
            if obs and obs.get("ok"):
                self.waiting.remove(rid)
                self.loading.append(rid)
            return
        if self.steps.schedule(rid, use_hit=True, external=ext):
            self.steps.commit(rid)
            self.waiting.remove(rid)
            self.running.append(rid)

    def finish(self) -> None:
        if self.running:
            rid = self.draw(st.sampled_from(self.running))
            self.steps.finish(rid)
            self.running.remove(rid)

    def preempt(self) -> None:
        if self.running:
            rid = self.draw(st.sampled_from(self.running))
            self.run.apply(op("preempt", rid=rid))
            self.running.remove(rid)
            self.waiting.append(rid)

    def evict(self) -> None:
        prompts = self.run.prompts
        if prompts:
            rid = self.draw(st.sampled_from(sorted(prompts)))
            b = self.h * self.draw(st.integers(1, max(1, len(prompts[rid]) // self.h)))
            group = self.draw(st.integers(0, self.num_groups - 1))
            self.run.apply(op("evict", keys=[[group, b]]))

    def pool_state(self) -> None:
        self.run.apply(op("pool_state"))


@st.composite
def lockstep_trace(draw: st.DrawFn, adapters: list[str], max_steps: int = 16,
                   strict: bool = True, junction_checkpoint: bool | None = False) -> Lockstep:
    """Draw and run one trace on ``adapters`` (raises LockstepDivergence on disagreement).
    ``junction_checkpoint`` turns vLLM's shared-prefix junction checkpoint on (True: the
    engine flag with EAGLE flagged on the Mamba groups), off (False), or draws it (None)."""
    geometry = draw(st.sampled_from(GEOMETRIES))
    if junction_checkpoint is None:
        junction_checkpoint = draw(st.booleans())
    settings: dict[str, Any] = {}
    if junction_checkpoint:
        geometry = with_junction_checkpoint(geometry)
        settings["enable_mamba_shared_prefix_checkpoint"] = True
    config = geometry_config(geometry, draw(st.sampled_from([8, 12, 16, 24, 40])), **settings)
    sizes = [b for _, b, _ in geometry[0]]
    if min(sizes) < max(sizes) and draw(st.booleans()):
        config["split_block_size"] = min(sizes)  # the engine's cache_config.block_size
    if any(k == M for k, _, _ in geometry[0]):
        # MambaSpec.num_speculative_blocks: one per speculative token, the same on every
        # Mamba group (the drafts decode_with_drafts schedules run on any S).
        spec_blocks = draw(st.sampled_from([0, 0, 0, 1, 2]))
        if spec_blocks:
            for g in config["groups"]:
                if g["kind"] == M:
                    g["num_speculative_blocks"] = spec_blocks
    run = Lockstep(config, adapters, strict, name="generated")
    script = _CoreScript(draw, run, geometry)
    for _ in range(draw(st.integers(1, max_steps))):
        script.step()
    for rid in script.running:
        run.apply(op("free", rid=rid))
    run.apply(op("pool_state"))
    if draw(st.booleans()):
        run.apply(op("reset"))
    return run


def write_case(doc: dict[str, Any], path: Path) -> Path:
    """Write a (shrunk) diverging trace as a corpus-ready file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
