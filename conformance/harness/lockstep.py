"""Lockstep runs: each op goes to several adapters at once and their observations are compared
right after it, so a trace can be written op by op (each next op chosen from the observations
so far) and stops at the first op where the adapters disagree.

The replay runner (``replay.py``) runs finished traces adapter by adapter; this runner is for
tools that build traces while running them: the case author, the property-test generators.
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.compare import Renamer
from tailproof.conformance.format.trace import FORMAT_TAG, OpReader, parse_trace
from tailproof.conformance.harness.adapters import make_driver
from tailproof.conformance.harness.backend import RequestView
from tailproof.conformance.harness.driver import CoreDriver

Op = dict[str, Any]
Observation = dict[str, Any]


class LockstepDivergence(AssertionError):
    """Adapters disagreed; ``doc`` is the trace up to and including the diverging op, whose
    ``expect`` is the first adapter's observation (ready to join the corpus)."""

    def __init__(self, message: str, doc: dict[str, Any], index: int,
                 observations: list[Observation | None]) -> None:
        super().__init__(message)
        self.doc = doc
        self.index = index
        self.observations = observations


class Lockstep:
    """Runs ops on every adapter in ``adapters`` (fresh drivers), comparing each op's
    observations exactly (``strict``) or up to a renaming of block ids; the first adapter's
    observations are the ones returned and recorded."""

    def __init__(self, config_doc: dict[str, Any], adapters: list[str] | tuple[str, ...],
                 strict: bool = True, name: str = "lockstep") -> None:
        self.config_doc = config_doc
        self.adapters = list(adapters)
        self.strict = strict
        self.name = name
        config = parse_trace(self.doc([])).config
        self.drivers: list[CoreDriver] = [make_driver(a, config) for a in self.adapters]
        self.renamers = [Renamer() for _ in self.adapters]
        self.reader = OpReader()
        self.ops: list[Op] = []  # as written (compact)
        self.observed: list[Observation | None] = []  # the first adapter's

    @property
    def prompts(self) -> dict[str, list[int]]:
        """The expanded prompt of every request added so far."""
        return self.reader.prompts

    def request(self, rid: str) -> RequestView:
        """A request's token counts as the first adapter's scheduler sees them."""
        return self.drivers[0].core.get(rid)

    def doc(self, ops: list[Op] | None = None, description: str = "") -> dict[str, Any]:
        """The trace document of ``ops`` (default: the ops run so far)."""
        return {"format": FORMAT_TAG, "name": self.name,
                "description": description or f"lockstep run on {', '.join(self.adapters)}",
                "config": self.config_doc, "ops": self.ops if ops is None else ops}

    def apply(self, op: Op) -> Observation | None:
        """Run ``op`` on every adapter; the first adapter's observation (None where it does not
        run that op). Raises ``LockstepDivergence`` when two observations differ."""
        norm = self.reader.read(len(self.ops), op)
        self.ops.append(op)
        obs = [d.apply(norm) for d in self.drivers]
        seen = obs if self.strict else [
            o if o is None else r.canon(o) for o, r in zip(obs, self.renamers, strict=True)]
        for name, other in zip(self.adapters[1:], seen[1:], strict=True):
            if other is not None and seen[0] is not None and other != seen[0]:
                doc = self.doc([dict(x) for x in self.ops])
                doc["ops"][-1]["expect"] = obs[0]
                raise LockstepDivergence(
                    f"op {len(self.ops) - 1} {op['op']}: {self.adapters[0]}={seen[0]} "
                    f"{name}={other}", doc, len(self.ops) - 1, obs)
        self.observed.append(obs[0])
        return obs[0]


def replay_lockstep(doc: dict[str, Any], adapters: list[str] | tuple[str, ...],
                    strict: bool = True) -> LockstepDivergence | None:
    """Run a finished trace document in lockstep; the first divergence, or None."""
    run = Lockstep(doc["config"], adapters, strict, doc.get("name", "lockstep"))
    try:
        for op in doc["ops"]:
            run.apply({k: v for k, v in op.items() if k != "expect"})
    except LockstepDivergence as e:
        return e
    return None
