"""Hypothesis state machine: the spec explored at random.

``SpecMachine`` runs random enabled actions of :mod:`spec.model` on random small instances and
checks every invariant of :data:`spec.invariants.ALL` after each step; a failure names the
invariant and hypothesis prints the shrunk action sequence. (The refinement machines, which
drive an implementation through the conformance backends, live in
``tailproof.conformance.harness.refinement``: the spec imports nothing from the harness.)
"""

from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from . import invariants as inv
from .model import Config, State, initial

GEOMETRIES = [(2, 2, 4), (1, 1, 2), (2, 4, 4), (2, 2, 8)]  # (h, bs_fa, bs_mamba)
BASE = (1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)  # every prompt is a prefix: keys name prefixes


class SpecMachine(RuleBasedStateMachine):
    """Random walks of the spec with every invariant checked after each step."""

    steps = 0  #: actions taken by every instance in this process (the CI test reports them)

    def __init__(self) -> None:
        super().__init__()
        self.s: State | None = None

    @initialize(geo=st.sampled_from(GEOMETRIES),
                lens=st.lists(st.integers(2, 7), min_size=1, max_size=3),
                blocks=st.integers(5, 12), workers=st.integers(1, 2),
                defer=st.booleans(), eagle=st.booleans(),
                decode=st.lists(st.integers(0, 5), max_size=3), turn_end=st.booleans(),
                junction=st.booleans())
    def setup(self, geo: tuple[int, int, int], lens: list[int], blocks: int, workers: int,
              defer: bool, eagle: bool, decode: list[int], turn_end: bool,
              junction: bool) -> None:
        h, bf, bm = geo
        # A later prompt's junction: the prefix it shares with the longest earlier one, h-floored.
        junctions = tuple(min(n, max(lens[:i])) // h * h if junction and i else 0
                          for i, n in enumerate(lens))
        # Responses continue BASE, so a later prompt may be an earlier prompt + its response.
        responses = tuple(BASE[n:n + k] for n, k in zip(lens, decode, strict=False))
        cfg = Config(h=h, bs_fa=bf, bs_mamba=bm, num_blocks=blocks,
                     prompts=tuple(BASE[:n] for n in lens), workers=workers,
                     defer_block_free=defer, use_eagle=eagle, responses=responses,
                     turn_end=turn_end, junctions=junctions)
        note(f"config: {cfg}")
        self.s = initial(cfg)

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        assert self.s is not None
        a = data.draw(st.sampled_from(self.s.enabled()), label="action")
        self.s = self.s.apply(a)
        SpecMachine.steps += 1

    @invariant()
    def invariants_hold(self) -> None:
        """Every invariant in :data:`spec.invariants.ALL`, in order; the first violated one is
        named in the error."""
        if self.s is not None:
            for name, holds in inv.ALL:
                msg = holds(self.s)
                assert msg is None, f"{name}: {msg}"
