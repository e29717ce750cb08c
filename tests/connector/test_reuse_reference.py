"""The turn-end checkpoint extension's trace config, its refusal by the vLLM adapters, and the
reference model's snapshot-block rules (``reference/connector/turn_end.py``) in isolation."""

from __future__ import annotations

from typing import Any

import pytest

from tailproof.conformance.capture.connector_config import connector_config
from tailproof.conformance.format.connector_config import extension_on, validate_connector_config
from tailproof.conformance.format.trace import FORMAT_TAG, TraceError, parse_trace
from tailproof.conformance.harness.adapters import AdapterRefused, make_driver, refusal
from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.meta import RequestTracker
from tailproof.reference.connector.turn_end import TurnEnd

FA, M, SW = "full_attention", "mamba_align", "sliding_window"


def _doc(connector: dict[str, Any], groups: list[dict[str, Any]] | None = None,
         **extra: Any) -> dict[str, Any]:
    groups = groups or [{"kind": FA, "block_size": 16}, {"kind": M, "block_size": 16}]
    return {"format": FORMAT_TAG, "config": {"groups": groups, "hash_block_size": 4,
                                             "num_blocks": 16, "connector": connector, **extra},
            "ops": []}


def test_extension_keys_typed_and_written_only_when_given() -> None:
    base = validate_connector_config({})
    assert not set(base) & {"turn_end_checkpoints", "checkpoint_slots"}
    on = validate_connector_config({"turn_end_checkpoints": True, "checkpoint_slots": 2})
    assert on["turn_end_checkpoints"] is True and on["checkpoint_slots"] == 2
    assert extension_on(on) and not extension_on(base)
    assert extension_on(validate_connector_config({"decode_boundary_saves": True}))
    for bad, msg in [({"checkpoint_slots": 0}, ">= 1"), ({"checkpoint_reserve_blocks": -1}, ">= 0"),
                     ({"turn_end_checkpoints": 1}, "bool"), ({"checkpoint_slots": True}, "int")]:
        with pytest.raises(ValueError, match=msg):
            validate_connector_config(bad)


@pytest.mark.parametrize(("groups", "extra", "why"), [
    (None, {"use_eagle": True}, "EAGLE"),
    ([{"kind": FA, "block_size": 16}, {"kind": M, "block_size": 16,
                                       "num_speculative_blocks": 1}], {}, "speculative blocks"),
    ([{"kind": FA, "block_size": 16}, {"kind": SW, "block_size": 16, "sliding_window": 32},
      {"kind": M, "block_size": 16}], {}, "sliding-window"),
])
def test_extension_refuses_speculation_and_windows(groups: Any, extra: dict[str, Any],
                                                   why: str) -> None:
    with pytest.raises(TraceError, match=f"config.connector.turn_end_checkpoints: .*{why}"):
        parse_trace(_doc({"turn_end_checkpoints": True}, groups, **extra))
    parse_trace(_doc({}, groups, **extra))  # without the extension the config is fine


def test_vllm_adapters_refuse_extension_traces_with_the_reason() -> None:
    config = parse_trace(_doc({"decode_boundary_saves": True})).config
    assert refusal("reference", config) is None and refusal("impl", config) is None
    for name in ("vllm", "vllm-mooncake"):
        why = refusal(name, config)
        assert why is not None and "decode_boundary_saves" in why and "vLLM 0.33" in why
        with pytest.raises(AdapterRefused, match="decode_boundary_saves"):
            make_driver(name, config)
    assert refusal("vllm-mooncake", parse_trace(_doc({})).config) is None


def test_capture_keeps_the_tailproof_extension_keys() -> None:
    from types import SimpleNamespace

    ktc = SimpleNamespace(kv_connector="TailproofConnector", kv_role="kv_both",
                          kv_connector_extra_config={"turn_end_checkpoints": True,
                                                     "checkpoint_slots": 8})
    cfg = connector_config(SimpleNamespace(kv_transfer_config=ktc,
                                           parallel_config=SimpleNamespace(world_size=1)))
    assert cfg is not None and cfg["turn_end_checkpoints"] and cfg["checkpoint_slots"] == 8
    assert cfg["checkpoint_lookup_wait"] is True  # impl's default, not the traces' (false)


class _Pool:
    """A free list of block ids standing in for the block pool."""

    def __init__(self, n: int) -> None:
        self.free = list(range(1, n))

    def take_ids(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def num_free(self) -> int:
        return len(self.free)

    def free_ids(self, ids: list[int]) -> None:
        self.free += ids


def _turn_end(pool: _Pool, **conf: Any) -> TurnEnd:
    geo = StoreGeometry.from_config(parse_trace(_doc({})).config)
    return TurnEnd(ConnectorConfig(turn_end_checkpoints=True, **conf), geo, pool)


def _snaps(te: TurnEnd, rows: list[tuple[str, int, int, Any]]) -> list[Any]:
    """``take_snapshots`` of rows whose requests name no last boundary (rule 3b off)."""
    out, final = te.take_snapshots([(*r, -1) for r in rows])
    assert final == []
    return out


def test_snapshot_due_only_past_ck_on_hash_boundaries_and_overwritten() -> None:
    pool = _Pool(16)
    te = _turn_end(pool)
    table = ([1, 2], [0, 7])  # Mamba running state after 17..32 tokens: block 7
    # P = 13, ck 12: 12 is not past ck, 18 is not a boundary; 20 is.
    assert _snaps(te, [("A", 12, 13, table), ("A", 18, 13, table)]) == []
    (s,) = _snaps(te, [("A", 20, 13, table)])
    assert (s.group, s.src, s.boundary) == (1, 7, 20) and te.slots == {"A": ([s.slot], 20)}
    (s2,) = _snaps(te, [("A", 24, 13, table)])
    assert s2.slot == s.slot and te.slots["A"] == ([s.slot], 24)  # same block, moved boundary
    assert _snaps(te, [("B", 16, 13, ([1], [0]))]) == []  # null source: none


def test_bounds_and_release() -> None:
    pool = _Pool(8)  # 7 free
    te = _turn_end(pool, checkpoint_slots=1, checkpoint_reserve_blocks=5)
    table = ([1, 2], [3, 4])
    assert len(_snaps(te, [("A", 20, 13, table), ("B", 20, 13, table)])) == 1
    assert set(te.slots) == {"A"}  # B: checkpoint_slots reached
    te.release("A")
    assert pool.num_free() == 7
    te = _turn_end(pool, checkpoint_reserve_blocks=7)
    assert _snaps(te, [("A", 20, 13, table)]) == []  # 7 - 1 < 7: refused


def test_flush_guard_releases_the_slot() -> None:
    pool = _Pool(8)
    te = _turn_end(pool)
    _snaps(te, [("A", 20, 13, ([1, 2], [3, 4]))])
    tracker = RequestTracker(req_id="A", token_len=13, allocated_block_ids=([], []))
    hashes = [bytes([i]) for i in range(5)]
    assert te.flush("A", tracker, 19, hashes, 13, ([1, 2], [3, 4])) is None  # 20 > computed
    assert te.slots == {} and pool.num_free() == 7
    out, final = te.take_snapshots([("A", 20, 13, ([1, 2], [3, 4]), 20)])  # rule 3b: last one
    assert final == ["A"] and len(out) == 1
    te.release("A")
    _snaps(te, [("A", 20, 13, ([1, 2], [3, 4]))])
    job = te.flush("A", tracker, 21, hashes, 13, ([1, 2], [3, 4]))
    assert job is not None and job.token_len_chunk == 0
    assert [(p.group_id, p.num_tokens) for p in job.boundary_puts] == [(0, 16), (0, 20), (1, 20)]
