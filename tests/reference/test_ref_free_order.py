"""Freeing a request's blocks in table order instead of reversed changes the block ids handed
out later, so the scenarios would catch that mutation."""

from __future__ import annotations

import pytest
from ref_scenarios import all_scenarios
from test_ref_scenarios import run_expectations

from tailproof.reference.managers import FullAttentionManager


def _free_in_table_order(self: FullAttentionManager, request_id: str) -> None:
    self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))


def test_reversed_free_order_is_what_matches() -> None:
    assert run_expectations(all_scenarios()["C1"], "reference") == []


def test_unreversed_free_changes_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FullAttentionManager, "free", _free_in_table_order)
    scenarios = all_scenarios()
    problems = run_expectations(scenarios["C1"], "reference")
    assert problems and "free_queue" in problems[0]
    # Consumers that allocate after the free get other ids too.
    assert run_expectations(scenarios["C2"], "reference") != []
