"""Refinement: an implementation of the core backend interface against the spec's invariants.

``RefinementMachine`` drives a ``CoreBackend`` (``conformance/harness/backend.py``; the reference
model by default, vLLM 0.33's ``KVCacheManager`` through ``VllmCoreBackend`` in the ``vllm`` test)
with random scheduler-shaped op sequences -- steps of lookups/allocations/commits, drains, retention
releases, finishes, preemptions, evictions and resets -- and after each op maps the
implementation's observable state (refcounts, free queue, keys, tables, held retentions, the last
lookup/drain/reset) to a spec :class:`~tailproof.spec.model.State` and checks the spec
invariants on it. The invariants about bytes, store jobs and producer markers (I6, I7, I11, I14,
I17, I18) are not observable through the core interface and hold vacuously on the abstraction;
I8 is checked at drain time (docs/spec.md lists where each invariant is checked).

Hypothesis prints the minimal op sequence on failure (``note`` records each op).
"""

from __future__ import annotations

from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tailproof.conformance.format.trace import GroupConfig, TraceConfig
from tailproof.conformance.harness.adapters.reference_core import ReferenceCoreBackend
from tailproof.conformance.harness.adapters.vllm_core import VllmCoreBackend
from tailproof.spec import invariants as inv
from tailproof.spec.machines import BASE, GEOMETRIES
from tailproof.spec.model import FA, MAMBA, Config, Hit, Req, State, initial

#: invariants checked on the abstraction of an implementation's observable state
REFINED = ("I1", "I2", "I3", "I4", "I9", "I10", "I12", "I19")


def vllm_core(config: TraceConfig) -> Any:
    """vLLM 0.33's ``KVCacheManager`` behind the core interface (vLLM imported when built)."""
    return VllmCoreBackend(config)


def trace_config(cfg: Config) -> TraceConfig:
    """The trace configuration of a spec instance (FA group 0, Mamba align group 1)."""
    return TraceConfig(groups=(GroupConfig("full_attention", cfg.bs_fa),
                               GroupConfig("mamba_align", cfg.bs_mamba)),
                       hash_block_size=cfg.h, num_blocks=cfg.num_blocks, use_eagle=cfg.use_eagle)


def abstract(cfg: Config, core: Any, rids: list[str], status: dict[str, str],
             retained: list[list[int]], last_hit: Hit | None,
             offloads: list[tuple[int, int, int, int]], reset: tuple[bool, bool] | None) -> State:
    """The spec state an implementation's observable state stands for."""
    s = initial(cfg)
    refs = core.refcounts()
    s.ref = [0] + [refs.get(b, 0) for b in range(1, cfg.num_blocks)]
    s.fq = list(core.free_queue())
    s.keys = {(g, BASE[:n]): b for g, n, b in core.keys()}
    for (g, p), b in s.keys.items():  # bytes are not observable: assume the key's own
        s.content[b] = (g, p)
    reqs = []
    for i, rid in enumerate(rids):
        r = Req(cfg.prompts[i], status=status[rid])
        if status[rid] != "finished":
            tab = core.table(rid)
            r.fa, r.mamba = list(tab[FA]), list(tab[MAMBA])
            r.computed = core.get(rid).num_computed_tokens
        reqs.append(r)
    s.reqs = reqs
    s.retained = [(0, tuple(ids), "cow") for ids in retained]
    s.offloads = offloads
    s.last_hit, s.last_reset = last_hit, reset
    return s


class RefinementMachine(RuleBasedStateMachine):
    """Random scheduler-shaped op sequences on an implementation; after each op the
    abstraction of its state must satisfy the spec invariants in ``REFINED``."""

    make_core = staticmethod(ReferenceCoreBackend)
    steps = 0  #: ops applied by every instance in this process (the CI test reports them)

    def __init__(self) -> None:
        super().__init__()
        self.core: Any = None
        self.cfg: Config | None = None

    @initialize(geo=st.sampled_from(GEOMETRIES),
                lens=st.lists(st.integers(2, 10), min_size=1, max_size=3),
                blocks=st.integers(6, 14))
    def setup(self, geo: tuple[int, int, int], lens: list[int], blocks: int) -> None:
        h, bf, bm = geo
        self.cfg = Config(h=h, bs_fa=bf, bs_mamba=bm, num_blocks=blocks,
                          prompts=tuple(BASE[:n] for n in lens), workers=1)
        note(f"config: {self.cfg}")
        self.core = self.make_core(trace_config(self.cfg))
        self.rids = [f"r{i}" for i in range(len(lens))]
        self.status = {r: "waiting" for r in self.rids}
        for rid, p in zip(self.rids, self.cfg.prompts, strict=True):
            self.core.add_request(rid, list(p), 16)
        self.retained: list[list[int]] = []
        self.last_hit: Hit | None = None
        self.offloads: list[tuple[int, int, int, int]] = []
        self.reset: tuple[bool, bool] | None = None

    def _clear(self) -> None:
        self.last_hit, self.offloads, self.reset = None, [], None
        RefinementMachine.steps += 1

    def _plan_alloc(self, i: int, use_hit: bool, hit: int) -> None:
        rid = self.rids[i]
        view = self.core.get(rid)
        start = view.num_computed_tokens + hit
        n = self.core.plan_chunk(rid, view.num_tokens - start, hit, 0)
        if n <= 0:
            return
        new = self.core.allocate(rid, n, use_hit=use_hit, external=0, delay_cache=False,
                                 lookahead=0)
        note(f"allocate {rid} n={n} use_hit={use_hit} -> {new}")
        if new is not None:
            self.core.set_counters(rid, num_computed_tokens=self.core.get(rid)
                                   .num_computed_tokens + n)
            self.status[rid] = "running"

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduling pass: new_step, allocations of a random subset (waiting requests
        look up and adopt their hit), preemptions of unscheduled running requests, then the
        drains (offloads, copies) and an immediate or deferred retention release."""
        assert self.cfg is not None
        self._clear()
        self.core.new_step()
        note("new_step")
        order = data.draw(st.permutations(range(len(self.rids))), label="order")
        for i in order:
            rid = self.rids[i]
            what = data.draw(st.sampled_from(["skip", "schedule", "preempt"]), label=rid)
            if what == "schedule" and self.status[rid] == "waiting":
                hit, blocks = self.core.lookup(rid, None)
                note(f"lookup {rid} -> {hit} {blocks}")
                self.last_hit = Hit(i, len(self.cfg.prompts[i]), hit, tuple(blocks[FA]),
                                    tuple(blocks[MAMBA]), self._keys())
                self._check(("I9", "I10"))
                self._plan_alloc(i, True, hit)
            elif what == "schedule" and self.status[rid] == "running":
                if self.core.get(rid).num_computed_tokens < len(self.cfg.prompts[i]):
                    self._plan_alloc(i, False, 0)
            elif what == "preempt" and self.status[rid] == "running":
                self.core.preempt(rid)
                note(f"preempt {rid}")
                self.status[rid] = "waiting"
        self.last_hit = None
        offs = self.core.drain_offloads()
        note(f"drain_offloads -> {offs}")
        self.offloads = [(self.rids.index(r), g, b, n) for r, g, b, n in offs]
        self._check(("I12",))  # undrained copies still hold refs: only I12 is meaningful here
        self.offloads = []
        copies, ret = self.core.drain_copies()
        note(f"drain_copies -> {copies} {ret}")
        refs = self.core.refcounts()
        assert all(refs.get(b, 0) >= 1 for b in ret), "I8: drained copy endpoint not held"
        if ret:
            self.retained.append(list(ret))
            if data.draw(st.booleans(), label="release now"):
                self._release(0 if len(self.retained) == 1 else len(self.retained) - 1)

    def _release(self, idx: int) -> None:
        ids = self.retained.pop(idx)
        self.core.release(ids)
        note(f"release {ids}")

    def _keys(self) -> frozenset:
        return frozenset((g, BASE[:n]) for g, n, _ in self.core.keys())

    @precondition(lambda self: bool(getattr(self, "retained", None)))
    @rule()
    def release_oldest(self) -> None:
        self._clear()
        self._release(0)

    @rule(i=st.integers(0, 2))
    def finish(self, i: int) -> None:
        self._clear()
        if i < len(self.rids) and self.status[self.rids[i]] == "running":
            rid = self.rids[i]
            tails = self.core.finalize_tail(rid)
            self.core.free(rid)
            note(f"finish {rid} (tails {tails})")
            self.status[rid] = "finished"

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        self._clear()
        keys = self.core.keys()
        if keys:
            g, n, b = data.draw(st.sampled_from(keys), label="key")
            self.core.evict({b})
            note(f"evict block {b} ({g},{n})")

    @rule()
    def reset(self) -> None:
        self._clear()
        all_free = self.core.num_free() == self.cfg.num_blocks - 1 if self.cfg else False
        ok = self.core.reset()
        note(f"reset -> {ok}")
        self.reset = (ok, all_free)

    @invariant()
    def abstraction_satisfies_spec(self) -> None:
        self._check()

    def _check(self, names: tuple[str, ...] = REFINED) -> None:
        if self.core is None or self.cfg is None:
            return
        s = abstract(self.cfg, self.core, self.rids, self.status, self.retained,
                     self.last_hit, self.offloads, self.reset)
        funcs = dict(inv.ALL)
        for name in names:
            msg = funcs[name](s)
            assert msg is None, f"{name}: {msg}"


class VllmRefinementMachine(RefinementMachine):
    """The same machine on vLLM 0.33's own ``KVCacheManager``."""

    make_core = staticmethod(vllm_core)
