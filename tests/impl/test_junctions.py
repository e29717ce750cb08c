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
