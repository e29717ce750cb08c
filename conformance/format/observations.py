"""The keys each op's observation can carry, on any adapter, derived from the op declarations
(``ops.OPS``: ``Op.observes``) plus ``free`` (every op) and ``error`` (an op that raised). The
loader refuses an ``expect`` key outside its op's set (``step_protocol``), so ``validate`` and
``replay`` reject the same traces; ``tests/conformance/test_step_protocol.py`` checks the
declarations against the corpus's runs.
"""

from __future__ import annotations

from tailproof.conformance.format.ops import ALWAYS_OBSERVED, OPS

OBSERVES: dict[str, frozenset[str]] = {name: op.observes | ALWAYS_OBSERVED
                                       for name, op in OPS.items()}
