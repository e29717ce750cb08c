"""Hypothesis strategy: mixed core + connector traces run on vLLM 0.33 + Mooncake and on the
reference in lockstep (``tailproof.conformance.harness.lockstep``), with scripted store failures.

Each trace follows the scheduler's order per step (``tailproof.conformance.harness.steps``: running
chunks, admissions through the connector lookup, hand-off/copy drains, ``conn_step``,
commits), with random decodes, finishes (``conn_finish`` + ``free``), preemptions, worker runs
with scripted put outcomes, partial reports and lookups. The first op whose observations
differ (block ids compared exactly) raises ``ConnectorDivergence`` carrying the trace so far,
with vLLM's observation as the expectation, ready to be written as a case file.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tailproof.conformance.harness.lockstep import Lockstep as Run
from tailproof.conformance.harness.lockstep import LockstepDivergence as ConnectorDivergence
from tailproof.conformance.harness.steps import Steps, op
from tailproof.conformance.tools.generate import FA, SW, Geometry, M, geometry_config, prompt_tokens

__all__ = ["WINDOW_GEOMETRIES", "ConnectorDivergence", "Run", "connector_trace"]

ADAPTERS = ("vllm-mooncake", "reference")
GEOMETRIES: list[Geometry] = [
    ([(FA, 16, False), (M, 16, False)], 4, False),
    ([(FA, 4, False), (M, 16, False)], 4, False),
    ([(FA, 4, False), (M, 8, False)], 2, False),
    ([(FA, 2, False), (M, 4, False)], 2, False),
    ([(FA, 16, True), (M, 16, False)], 4, True),
    ([(FA, 8, False), (M, 8, False), (M, 8, False)], 4, False),
    ([(FA, 8, False), (M, 8, False)], 8, False),  # partial hits off
    ([(FA, 8, False), (M, 8, False)], 4, True),  # EAGLE, no group flagged: every group EAGLE
    ([(FA, 4, True), (FA, 8, False), (M, 8, False)], 4, True),  # EAGLE on one FA group of two
    ([(FA, 16, False), (M, 8, False)], 8, False),  # h = Mamba block < lcm
]
# A sliding-window group beside FA and Mamba (window = block + 1, geometry_config): the store
# keeps and probes only the window blocks a hit at an lcm boundary needs (store_mask /
# lookup_mask), and a request past its window holds null blocks there. Drawn on their own
# (``connector_trace(WINDOW_GEOMETRIES)``), so the fixed budgets drawn from GEOMETRIES stay.
WINDOW_GEOMETRIES: list[Geometry] = [
    ([(FA, 4, False), (SW, 4, False), (M, 16, False)], 2, False),  # partial hits off, lcm 16
    ([(FA, 4, False), (SW, 4, False), (M, 16, False)], 4, False),  # partial hits on (block = h)
    ([(FA, 16, False), (SW, 16, True), (M, 64, False)], 8, True),  # EAGLE on the window
    ([(FA, 8, False), (SW, 4, True), (M, 16, False)], 4, True),  # EAGLE, window block < FA's
]
SCRIPT_ENTRIES: list[Any] = ["ok", "ok", "ok", "full", "error", "raise", ["ok", "full"]]
RUNNING_ACTIONS = ["run", "run", "decode", "finish", "preempt", "idle"]
# With the extension: mostly decodes, so responses cross hash boundaries and get flushed.
EXTENSION_ACTIONS = ["run", "decode", "decode", "decode", "decode", "finish", "preempt"]


class _ConnectorScript:
    """The generator's scheduler and workers: what each engine step does."""

    def __init__(self, draw: st.DrawFn, run: Run, geometry: Geometry, workers: int) -> None:
        self.draw, self.run, self.workers = draw, run, workers
        self.steps = Steps(run.apply, connector=True)
        self.num_groups, self.h = len(geometry[0]), geometry[1]
        self.biggest = max(b for _, b, _ in geometry[0])
        self.waiting: list[str] = []
        self.running: list[str] = []
        # impl (real KV bytes) runs: a foreign offer is never a real Mamba block
        self.bytes_checked = "impl" in run.adapters
        self.actions = EXTENSION_ACTIONS if self.bytes_checked else RUNNING_ACTIONS
        self.finished: list[str] = []  # since the last conn_step
        self.preempted: list[str] = []

    def step(self) -> None:
        """One engine step, then the workers, the store and the arrivals for the next one."""
        self.steps.begin()
        ok = [rid for rid in list(self.running) if self.continue_running(rid)]
        ok += [rid for rid in list(self.waiting) if self.admit(rid)]
        self.steps.end(ok, finished=self.finished, preempted=self.preempted,
                       offer=self.foreign_offer(ok))
        self.finished, self.preempted = [], []
        self.run_workers()
        self.touch_store()
        for _ in range(self.draw(st.integers(0, 2))):  # arrivals join the next admissions
            self.arrive()

    def continue_running(self, rid: str) -> bool:
        """A running request's step: a chunk or a decode token, a finish, a preemption, or
        nothing. Returns whether a chunk was allocated."""
        action = self.draw(st.sampled_from(self.actions))
        view = self.run.request(rid)
        if action == "finish" or (action == "decode" and view.num_tokens > 4 * self.biggest):
            self.steps.finish(rid)
            self.running.remove(rid)
            self.finished.append(rid)
            return False
        if action == "preempt":
            self.run.apply(op("preempt", rid=rid))
            self.running.remove(rid)
            self.preempted.append(rid)
            self.waiting.append(rid)
            return False
        if action == "idle":
            return False
        if view.num_computed_tokens >= view.num_tokens:
            if action != "decode":
                return False
            self.run.apply(op("append_output", rid=rid, tokens=[self.draw(st.integers(0, 4))]))
        return self.steps.run(rid, budget=self.draw(st.sampled_from([None, self.biggest])))

    def admit(self, rid: str) -> bool:
        """Sometimes admit a waiting request (not one preempted in this step)."""
        if rid in self.preempted or not self.draw(st.booleans()):
            return False
        if not self.steps.admit(rid):
            return False
        self.waiting.remove(rid)
        self.running.append(rid)
        return True

    def foreign_offer(self, ok: list[str]) -> list[list[Any]]:
        """Sometimes a hand-off the core never produces (an attention-group block or the
        null block) for ``conn_step.offer``: the connector must refuse it."""
        if not ok or self.draw(st.integers(0, 3)) != 0:
            return []
        rid = self.draw(st.sampled_from(ok))
        table = self.run.drivers[0].core.table(rid)
        g = self.draw(st.integers(0, self.num_groups - 1))
        blk = table[g][-1] if table[g] and self.draw(st.booleans()) else 0
        if self.bytes_checked and self.run.drivers[0].config.groups[g].is_mamba:
            blk = 0  # a real Mamba block at a made-up boundary would be a wrong-bytes hand-off
        return [[rid, g, self.h * self.draw(st.integers(1, 4)), blk]]

    def run_workers(self) -> None:
        """Each worker runs some queued jobs with scripted put outcomes; sometimes report."""
        for w in range(self.workers):
            if self.draw(st.integers(0, 3)) > 0:
                script = self.draw(st.lists(st.sampled_from(SCRIPT_ENTRIES), max_size=3))
                self.run.apply(op("worker_run", worker=w,
                                  n=self.draw(st.sampled_from([None, 1])), store=script))
        if self.draw(st.booleans()):
            workers = self.draw(st.sampled_from([None] + [[w] for w in range(self.workers)]))
            self.run.apply(op("worker_report", workers=workers))

    def touch_store(self) -> None:
        """Sometimes a store lookup; sometimes drop the GPU prefix-cache keys of one prompt
        from some boundary on, so later admissions weigh a shorter local hit against the
        store."""
        prompts, h = self.run.prompts, self.h
        if prompts and self.draw(st.integers(0, 3)) == 0:
            self.run.apply(op("store_lookup", rid=self.draw(st.sampled_from(sorted(prompts)))))
        if prompts and self.draw(st.booleans()):
            rid = self.draw(st.sampled_from(sorted(prompts)))
            n = len(prompts[rid])
            cut = h * self.draw(st.integers(0, max(0, n // h)))
            end = self.draw(st.sampled_from([n + 1, cut + self.biggest]))
            keys = [[g, b] for g in range(self.num_groups) for b in range(max(h, cut), end, h)
                    if b <= n]
            if keys:
                self.run.apply(op("evict", keys=keys))

    def arrive(self) -> None:
        if len(self.run.prompts) < 6:
            rid = f"r{len(self.run.prompts)}"
            tokens = prompt_tokens(self.draw, self.h, self.biggest, self.run.prompts,
                                   ["shared", "shared", "sub_block", "edge", "short", "long"],
                                   4, near_full=False)
            self.run.apply(op("add_request", rid=rid, tokens=tokens))
            self.waiting.append(rid)


# The turn-end checkpoint extension (docs/reuse.md) refuses EAGLE, speculative blocks and windows.
EXTENSION_GEOMETRIES: list[Geometry] = [g for g in GEOMETRIES if not g[2]]
EXTENSION_ADAPTERS = ("reference", "impl")


@st.composite
def connector_trace(draw: st.DrawFn, geometries: list[Geometry] | None = None,
                    max_steps: int = 12, spec_blocks: bool = False,
                    extension: bool = False) -> Run:
    """Draw and run one connector trace on one of ``geometries`` (default ``GEOMETRIES``);
    raises ConnectorDivergence on disagreement. With ``spec_blocks`` the Mamba groups sometimes
    get speculative blocks; off, the draws are the ones ``tailproof mutate``'s fixed budget was
    scored with (an extra draw reshuffles them). With ``extension`` the connector turns the
    turn-end checkpoint extension on (drawn bounds; junction checkpoints sometimes too) and the
    trace runs on reference and impl (real KV bytes) instead of vLLM."""
    geometry = draw(st.sampled_from(geometries or GEOMETRIES))
    workers = draw(st.sampled_from([1, 1, 2]))
    connector = {"role": draw(st.sampled_from(["producer", "producer", "both", "consumer"])),
                 "num_workers": workers, "save_decode_cache": draw(st.booleans()),
                 "enable_lookup": draw(st.sampled_from([True, True, True, False]))}
    if extension:
        connector.update({
            "turn_end_checkpoints": draw(st.sampled_from([True, True, False])),
            "checkpoint_slots": draw(st.sampled_from([1, 2, 32])),
            "checkpoint_reserve_blocks": draw(st.sampled_from([0, 2, 4])),
            "decode_boundary_saves": draw(st.booleans()),
            "checkpoint_lookup_wait": draw(st.booleans()),
            # junction checkpoints (docs/junctions.md); a tiny index evicts prompts
            "junction_checkpoints": draw(st.booleans()),
            "junction_index_blocks": draw(st.sampled_from([3, 1 << 18]))})
        if not connector["turn_end_checkpoints"]:
            connector["decode_boundary_saves"] = True
    config = geometry_config(geometry, draw(st.sampled_from([10, 16, 24, 40])),
                             connector=connector)
    # MambaSpec.num_speculative_blocks on every Mamba group: scratch blocks are never keyed,
    # so the store sees them only through foreign offers.
    num_spec = draw(st.sampled_from([0, 0, 0, 1, 2])) if spec_blocks else 0
    for g in config["groups"]:
        if num_spec and g["kind"] == M:
            g["num_speculative_blocks"] = num_spec
    run = Run(config, EXTENSION_ADAPTERS if extension else ADAPTERS, name="connector-property")
    script = _ConnectorScript(draw, run, geometry, workers)
    for _ in range(draw(st.integers(1, max_steps))):
        script.step()
    for w in range(workers):
        run.apply(op("worker_run", worker=w))
    run.apply(op("worker_report"))
    run.apply(op("conn_state"))
    run.apply(op("pool_state"))
    return run
