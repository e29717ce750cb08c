"""``tailproof doctor``: what is installed, and what each piece enables, in one block.

Probes without running anything: vLLM (version, source, supported releases, the API each
vLLM-backed adapter drives, against each supported release's probe table), torch, z3,
hypothesis, the Mooncake store package and the libibverbs it links. Each line says what the
component enables, so a missing one reads as a consequence ("proofs: not available"), not as a
puzzle.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata as md
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from tailproof import __version__
from tailproof.conformance.harness import vllm_compat


@dataclass
class Item:
    name: str
    version: str | None  # None: absent
    enables: str
    note: str = ""
    details: list[str] = field(default_factory=list)  # more lines under the note

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "enables": self.enables,
                "available": self.version is not None, "note": self.note}


def _dist_version(module: str, dist: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "unknown"


def collect() -> tuple[vllm_compat.VllmInfo, list[Item]]:
    info = vllm_compat.inspect_vllm(all_releases=True)
    items = []
    vnote = ""
    if info.version is not None:
        vnote = (f"{info.source}, supported releases {', '.join(vllm_compat.RELEASES)}: "
                 + ("yes" if info.supported else "NO"))
        bad = [f"{a}: {'; '.join(p)}" for a, p in info.problems.items()]
        if info.release is not None:
            vnote += f"; API ({info.release} table): " + (
                " | ".join(bad) if bad else "every probed API present")
    items.append(Item("vllm", info.version,
                      "the vllm, vllm-mooncake and impl adapters (differential replay)", vnote,
                      release_lines(info)))
    items.append(Item("torch", _dist_version("torch", "torch"),
                      "everything vLLM-backed (vLLM's core imports it)"))
    items.append(Item("z3", _dist_version("z3", "z3-solver"),
                      "tailproof prove and the proofs of tailproof check"))
    items.append(Item("hypothesis", _dist_version("hypothesis", "hypothesis"),
                      "the spec's property tests and trace generation"))
    items.append(Item("mooncake", _dist_version("mooncake",
                                                "mooncake-transfer-engine-non-cuda"),
                      "--store mooncake (a real Mooncake store behind the impl adapter)"))
    lib = ctypes.util.find_library("ibverbs")
    items.append(Item("libibverbs", lib and "present",
                      "loading mooncake.store (it links libibverbs even over TCP)",
                      "" if lib else "apt-get install libibverbs1"))
    return info, items


def release_lines(info: vllm_compat.VllmInfo) -> list[str]:
    """One line per supported release: how the installed vLLM fares against its probe table
    (which adapters would lack what), the table in use marked."""
    lines = []
    for r, problems in info.release_problems.items():
        mark = " (in use)" if r == info.release else ""
        if not problems:
            lines.append(f"probes {r}{mark}: every probed API present")
            continue
        counts = ", ".join(f"{a} {len(p)}" for a, p in problems.items())
        missing = list(dict.fromkeys(x for p in problems.values() for x in p))
        lines.append(f"probes {r}{mark}: missing ({counts}): {'; '.join(missing)}")
    return lines


def report() -> dict[str, Any]:
    info, items = collect()
    return {"tool": {"name": "tailproof", "version": __version__}, "vllm": info.as_json(),
            "vllm_release": info.release, "vllm_release_probes": info.release_problems,
            "components": [i.as_json() for i in items]}


def render(items: list[Item]) -> str:
    lines = [f"tailproof {__version__}"]
    for i in items:
        state = i.version if i.version is not None else "not installed"
        lines.append(f"  {i.name:<11} {state:<14} enables {i.enables}")
        for note in ([i.note] if i.note else []) + i.details:
            lines.append(f"  {'':<11} {'':<14} {note}")
    return "\n".join(lines)
