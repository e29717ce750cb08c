"""The junction checkpoint extension's trace config and its refusal by the vLLM adapters, the
scheduler hook in both core backends, and the reference model's junction rules
(``reference/connector/junctions.py``) in isolation."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tailproof.conformance.format.connector_config import extension_on, validate_connector_config
from tailproof.conformance.format.trace import FORMAT_TAG, TraceError, parse_trace
from tailproof.conformance.harness.adapters import AdapterRefused, make_driver, refusal
from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.junctions import Junctions, PromptIndex

FA, M, SW = "full_attention", "mamba_align", "sliding_window"


def _doc(connector: dict[str, Any], groups: list[dict[str, Any]] | None = None,
         **extra: Any) -> dict[str, Any]:
    groups = groups or [{"kind": FA, "block_size": 16}, {"kind": M, "block_size": 16}]
    return {"format": FORMAT_TAG, "config": {"groups": groups, "hash_block_size": 4,
                                             "num_blocks": 16, "connector": connector, **extra},
            "ops": []}


def test_junction_keys_typed_bounded_and_written_only_when_given() -> None:
    base = validate_connector_config({})
    assert not set(base) & {"junction_checkpoints", "junction_index_blocks"}
    on = validate_connector_config({"junction_checkpoints": True, "junction_index_blocks": 8})
    assert on["junction_checkpoints"] is True and on["junction_index_blocks"] == 8
    assert extension_on(on) and not extension_on(base)
    assert not extension_on(validate_connector_config({"junction_index_blocks": 8}))
    for bad, msg in [({"junction_index_blocks": 0}, r"1\.\.16777216"),
                     ({"junction_index_blocks": 1 << 25}, r"1\.\.16777216"),
                     ({"junction_checkpoints": 1}, "bool"),
                     ({"junction_index_blocks": True}, "int")]:
        with pytest.raises(ValueError, match=msg):
            validate_connector_config(bad)


def test_junctions_refuse_speculation_and_windows() -> None:
    with pytest.raises(TraceError, match="config.connector.junction_checkpoints: .*EAGLE"):
        parse_trace(_doc({"junction_checkpoints": True}, use_eagle=True))
    groups = [{"kind": FA, "block_size": 16}, {"kind": SW, "block_size": 16,
                                               "sliding_window": 32}, {"kind": M, "block_size": 16}]
    with pytest.raises(TraceError, match="sliding-window"):
        parse_trace(_doc({"junction_checkpoints": True}, groups))


def test_vllm_adapters_refuse_junction_traces_with_the_reason() -> None:
    config = parse_trace(_doc({"junction_checkpoints": True})).config
    assert refusal("reference", config) is None and refusal("impl", config) is None
    for name in ("vllm", "vllm-mooncake"):
        why = refusal(name, config)
        assert why is not None and "junction_checkpoints" in why and "junctions.md" in why
        with pytest.raises(AdapterRefused, match="junction_checkpoints"):
            make_driver(name, config)


@pytest.mark.parametrize("adapter", ["reference", pytest.param("impl", marks=pytest.mark.vllm)])
def test_hook_makes_the_split_stop_at_the_junction(adapter: str) -> None:
    """With junction_checkpoints the adapters apply the scheduler hook: a chunk crossing the
    request's junction stops at it exactly (off: block-floored from the chunk start, 16)."""
    if adapter == "impl":
        pytest.importorskip("vllm")
    chunks = {}
    for on in (False, True):
        d = make_driver(adapter, parse_trace(_doc({"junction_checkpoints": on})).config)
        d.apply({"op": "add_request", "rid": "A", "tokens": list(range(40)), "max_tokens": 4})
        d.core.requests["A"].shared_prefix_boundary = 20
        chunks[on] = d.apply({"op": "plan_chunk", "rid": "A", "use_hit": False, "external": 0,
                              "budget": None, "drafts": 0})["chunk"]
    assert chunks == {False: 16, True: 20}


def test_prompt_index_lru_reverse_order_and_scan_from_the_limit() -> None:
    idx = PromptIndex(3)
    idx.add([b"a", b"b", b"c", b"d"], 4)  # d, c, b, a: a most recent; then d evicted
    assert list(idx.lru) == [b"c", b"b", b"a"]
    assert idx.longest([b"a", b"b", b"x", b"y"], 4) == 2
    assert idx.longest([b"a", b"b", b"c"], 2) == 2  # capped at the limit
    assert idx.longest([b"x", b"y", b"c"], 3) == 3  # a hole below: still the largest k
    assert idx.longest([b"x"], 1) == 0


class _Pool:
    def __init__(self, n: int) -> None:
        self.free = list(range(1, n))

    def take_ids(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def num_free(self) -> int:
        return len(self.free)

    def free_ids(self, ids: list[int]) -> None:
        self.free += ids


def _req(rid: str, hashes: list[bytes], p: int, spb: int = 0) -> Any:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=p, block_hashes=hashes,
                           shared_prefix_boundary=spb)


def _junctions(pool: _Pool, hook: bool = True, **conf: Any) -> Junctions:
    geo = StoreGeometry.from_config(parse_trace(_doc({})).config)
    j = Junctions(ConnectorConfig(junction_checkpoints=True, **conf), geo, pool)
    j.hook = hook
    return j


def test_junction_decision() -> None:
    shared = [bytes([i]) for i in range(5)]
    a = _req("A", [*shared, b"a5", b"a6", b"a7", b"a8", b"a9"], 40)
    j = _junctions(_Pool(16))
    j.at_lookup(a, 0)
    assert a.shared_prefix_boundary == 0 and j.seen == {"A": 0}
    b = _req("B", [*shared, b"b5", b"b6", b"b7", b"b8", b"b9"], 40)
    j.at_lookup(b, 16)
    assert b.shared_prefix_boundary == 20 and j.targets == {"B": 20}
    for hit, spb in [(20, 0), (16, 20)]:  # not past the hit / vLLM's own junction
        c = _req(f"C{hit}", b.block_hashes, 40, spb)
        j.at_lookup(c, hit)
        assert c.shared_prefix_boundary == spb and f"C{hit}" not in j.targets
    d = _req("D", [*shared[:4], b"d4"], 20)  # junction 16: on the Mamba grid
    j.at_lookup(d, 0)
    assert j.seen["D"] == 16 and "D" not in j.targets
    e = _req("E", shared[:5], 21)  # junction capped at (P-1)//h = 5 blocks = 20 = ck(21)
    j.at_lookup(e, 0)
    assert j.seen["E"] == 20 and "E" not in j.targets
    nohook = _junctions(_Pool(16), hook=False)
    nohook.at_lookup(a, 0)
    nohook.at_lookup(b2 := _req("B", b.block_hashes, 40), 16)
    assert b2.shared_prefix_boundary == 0 and not nohook.targets


def test_junction_job_reserve_and_order() -> None:
    pool = _Pool(8)  # 7 free
    j = _junctions(pool, checkpoint_reserve_blocks=6)
    a = _req("A", [bytes([i]) for i in range(10)], 40)
    b = _req("B", [*a.block_hashes[:5], *[bytes([50 + i]) for i in range(5)]], 40)
    j.at_lookup(a, 0)
    j.at_lookup(b, 16)
    table = ([3, 4], [0, 5])
    (copies, job, fresh), = j.jobs([(a, 16), (b, 20)], lambda rid: table)
    assert fresh == [1] and [(c.src, c.slot, c.boundary) for c in copies] == [(5, 1, 20)]
    assert [(p.group_id, p.block_id, p.num_tokens) for p in job.boundary_puts] == [
        (0, 4, 20), (1, 1, 20)]
    assert not j.targets
    j.at_lookup(b, 16)  # asked again: set again; now 6 free - 1 < 6: refused, spent
    assert j.jobs([(b, 20)], lambda rid: table) == [] and not j.targets


def test_vllm_junction_taken_only_where_the_core_keys_nothing() -> None:
    """At vLLM's own junction (j == shared_prefix_boundary) the connector stands down only when
    the core keys the state there (an EAGLE group); otherwise it takes the stop and the job."""
    shared = [bytes([i]) for i in range(5)]
    a = _req("A", [*shared, b"a5", b"a6", b"a7", b"a8", b"a9"], 40)
    hashes = [*shared, b"b5", b"b6", b"b7", b"b8", b"b9"]
    for keys, taken in [(True, False), (False, True)]:
        j = _junctions(_Pool(16))
        j.vllm_keys = keys
        j.at_lookup(a, 0)
        b = _req("B", hashes, 40, spb=20)
        j.at_lookup(b, 16)
        assert b.shared_prefix_boundary == 20 and ("B" in j.targets) is taken


def test_junction_stop_passed_is_spent_without_a_job() -> None:
    """A chunk that ends short of the junction keeps the stop pending; one that runs past it
    (vLLM re-assigned the junction) spends it: no copy, no job, no block taken."""
    pool = _Pool(16)
    j = _junctions(pool)
    shared = [bytes([i]) for i in range(5)]
    a = _req("A", [*shared, b"a5", b"a6", b"a7", b"a8", b"a9"], 40)
    b = _req("B", [*shared, b"b5", b"b6", b"b7", b"b8", b"b9"], 40)
    j.at_lookup(a, 0)
    j.at_lookup(b, 0)
    table = ([3, 4], [0, 5])
    assert j.jobs([(b, 16)], lambda rid: table) == [] and j.targets == {"B": 20}
    assert j.jobs([(b, 24)], lambda rid: table) == [] and not j.targets
    assert pool.num_free() == 15
