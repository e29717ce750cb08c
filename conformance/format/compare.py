"""Compare observations: exactly (``--strict-ids``) or up to a renaming of block ids.

In loose mode block ids are renamed by first appearance across the whole trace, so two
implementations that allocate different ids in the same pattern agree. The null block (0)
is never renamed.
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.ops import OPS

# Observation fields whose values are (lists of) block ids, and how ids sit inside them: the
# union over the op declarations (``ops.Op.ids``, ``id_pairs``, ``id_triples``), at any depth.
_ID_FIELDS = frozenset().union(*(op.ids for op in OPS.values()))
_PAIR_FIRST = frozenset().union(*(op.id_pairs for op in OPS.values()))  # [[id, ref], ...]
_TRIPLE_LAST = frozenset().union(*(op.id_triples for op in OPS.values()))  # [[g, b, id], ...]


class Renamer:
    """First-appearance renaming of block ids, one instance per (trace, adapter)."""

    def __init__(self) -> None:
        self.names: dict[int, int] = {0: 0}

    def __call__(self, block_id: int) -> int:
        if block_id not in self.names:
            self.names[block_id] = len(self.names)
        return self.names[block_id]

    def _ids(self, v: Any) -> Any:
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            return self(v)
        if isinstance(v, list):
            return [self._ids(x) for x in v]
        if isinstance(v, dict):
            return {k: self._ids(x) for k, x in v.items()}
        return v

    def canon(self, obs: Any) -> Any:
        """A copy of ``obs`` with every block id renamed."""
        if isinstance(obs, list):
            return [self.canon(x) for x in obs]
        if not isinstance(obs, dict):
            return obs
        out: dict[str, Any] = {}
        for k, v in obs.items():
            if k in _ID_FIELDS:
                out[k] = self._ids(v)
            elif k in _PAIR_FIRST and isinstance(v, list):
                out[k] = sorted([self(p[0]), p[1]] for p in v)
            elif k in _TRIPLE_LAST and isinstance(v, list):
                out[k] = sorted([t[0], t[1], self(t[2])] for t in v)
            else:
                out[k] = self.canon(v)
        return out


def subset_match(expected: Any, got: Any) -> bool:
    """Whether every field written in ``expected`` equals ``got``'s (extra fields in got are
    fine: an expectation may pin only part of an observation)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        return all(k in got and subset_match(v, got[k]) for k, v in expected.items())
    return expected == got


def project(expected: Any, got: Any) -> Any:
    """``got`` cut down to the fields ``expected`` writes (recursively), so that loose-mode
    renaming numbers the same ids on both sides: an adapter may observe ids in fields an
    expectation leaves out (a captured trace pins only ``free`` on connector ops)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        return {k: project(v, got[k]) for k, v in expected.items() if k in got}
    return got
