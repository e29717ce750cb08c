"""Which vLLM release each adapter follows, and when a trace naming another one still runs.

The reference follows the release a trace names (``config.vllm``, docs/releases.md). The
vLLM-backed adapters (``vllm``, ``vllm-mooncake``, ``impl``: vLLM's own core under each) run the
installed release. A trace that names another release runs on them only where the two releases
agree on it: where the reference observes the same stream under both. Anywhere else they refuse
it, naming the first op the releases disagree on; its counterpart for the installed release
(``*_v034`` cases) is what they run instead.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

from tailproof.conformance.format.ops import CORE_OPS
from tailproof.conformance.format.trace import Trace
from tailproof.conformance.harness import vllm_compat
from tailproof.conformance.harness.adapters import ADAPTERS, make_driver
from tailproof.reference.releases import RELEASES

#: the adapters whose core is the installed vLLM
VLLM_BACKED = frozenset(("vllm", "vllm-mooncake", "impl"))


@cache
def installed_release() -> str | None:
    """The installed vLLM's release (``"0.34"``), None when absent or not a supported one."""
    info = vllm_compat.detect()
    v = vllm_compat.version_tuple(info.version or "")
    name = f"{v[0]}.{v[1]}" if v else None
    return name if name in RELEASES else None


def _stream(trace: Trace, vllm: str) -> list[Any]:
    driver = make_driver("reference", replace(trace.config, vllm=vllm))
    try:
        return [driver.apply(op) for op in trace.ops]
    finally:
        driver.close()


class ReleaseGate:
    """Decides, once per trace, whether the vLLM-backed adapters run it (see module doc)."""

    def __init__(self, trace: Trace, installed: str | None = None) -> None:
        self.trace = trace
        self.installed = installed or installed_release()
        self._checked = False
        self._at: int | None = None

    def first_difference(self) -> int | None:
        """The first op the trace's release and the installed one observe differently on the
        reference; None when they agree on every op (or nothing is installed)."""
        named = self.trace.config.vllm
        if not self._checked:
            self._checked = True
            if self.installed is not None and self.installed != named:
                a, b = _stream(self.trace, named), _stream(self.trace, self.installed)
                self._at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                 if x != y), None)
        return self._at

    def refusal(self, name: str) -> str | None:
        """Why adapter ``name`` does not run the trace (None: it runs it). An adapter without
        a connector observes the ops before the first connector op only (``CoreDriver.apply``):
        a difference past them does not concern it."""
        if name not in VLLM_BACKED:
            return None
        at = self.first_difference()
        ops = self.trace.ops
        if ADAPTERS[name].connector is None:
            observed = next((i for i, op in enumerate(ops) if op["op"] not in CORE_OPS),
                            len(ops))
            at = at if at is not None and at < observed else None
        if at is None:
            return None
        op = self.trace.ops[at]["op"]
        return (f"{name}: config.vllm is {self.trace.config.vllm}: the installed vLLM "
                f"{self.installed} differs from it at ops[{at}] ({op}) (docs/releases.md); "
                f"a {self.installed} counterpart of the case runs instead")
