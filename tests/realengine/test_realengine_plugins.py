"""The test bed's vLLM entry points stay inert in a user's engine, and its native-op stand-ins
follow the contracts of the ops they replace (no engine started)."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys

import pytest

from tailproof.conformance.realengine import plugins

pytest.importorskip("vllm")


def test_entry_points_are_registered() -> None:
    plats = {e.name: e.value for e in md.entry_points(group="vllm.platform_plugins")}
    gen = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert plats.get("tailproof_testbed") == "tailproof.conformance.realengine.plugins:activate"
    assert gen.get("tailproof_testbed_model") == (
        "tailproof.conformance.realengine.plugins:register_model")


def test_platform_only_under_the_test_bed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugins.ENV, raising=False)
    assert plugins.activate() is None
    monkeypatch.setenv(plugins.ENV, "0")
    assert plugins.activate() is None
    monkeypatch.setenv(plugins.ENV, "1")
    assert plugins.activate() == plugins.PLATFORM


def test_user_engine_process_sees_neither_platform_nor_model() -> None:
    """In a fresh process without TAILPROOF_TESTBED, vLLM resolves no test-bed platform and
    the registry has no test-bed model (the entry points ran: vLLM loads them itself)."""
    code = ("import os; os.environ.pop('TAILPROOF_TESTBED', None)\n"
            "from vllm.platforms import current_platform\n"
            "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "from vllm import ModelRegistry\n"
            "from tailproof.conformance.realengine.model import ARCH\n"
            "print(type(current_platform).__name__, ARCH in ModelRegistry.get_supported_archs())")
    env = {k: v for k, v in os.environ.items() if k != plugins.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout.split()
    assert out[-2] != "TestBedPlatform" and out[-1] == "False", out


def test_slot_mapping_matches_vllm_kernel_contract() -> None:
    import torch

    from tailproof.conformance.realengine import ops

    block_size = 4
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # three requests, one empty
    positions = torch.tensor([0, 1, 5, 2, 3])
    table = torch.tensor([[7, 9, 0], [1, 2, 3], [4, 6, 8]], dtype=torch.int32)
    slots = torch.full((8,), 99, dtype=torch.int64)
    ops.compute_slot_mapping_kernel_impl(qsl, positions, table, slots, block_size)
    # ComputeSlotMappingKernel: block_table[req, pos // bs] * bs + pos % bs; padding = -1
    want = [7 * 4 + 0, 7 * 4 + 1, 9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, -1, -1, -1]
    assert slots.tolist() == want


def test_greedy_and_gumbel_argmax() -> None:
    import torch

    from tailproof.conformance.realengine import ops

    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, -1.0, 0.0]])
    assert ops.greedy_argmax(logits).tolist() == [1, 0]  # first index on ties
    seeds = torch.tensor([3, 4])
    a, b = ops.fused_gumbel_argmax(logits, seeds), ops.fused_gumbel_argmax(logits, seeds)
    assert a.tolist() == b.tolist()  # a row's noise comes from its seed
    peaked = torch.tensor([[0.0, 100.0, 0.0]])
    assert ops.fused_gumbel_argmax(peaked, torch.tensor([1])).tolist() == [1]
