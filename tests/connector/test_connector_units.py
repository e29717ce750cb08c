"""Unit checks of the reference connector model against numbers verified on vLLM 0.33
(``_partial_tail_non_mamba_puts`` and the lookup rules) and of the connector trace
format (config validation, store scripts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tailproof.conformance.format.connector_config import validate_connector_config
from tailproof.conformance.format.ops import CONNECTOR_OP_SPECS, all_op_specs
from tailproof.conformance.format.trace import FORMAT_TAG, TraceError, parse_trace
from tailproof.reference.connector.config import StoreGeometry
from tailproof.reference.connector.lookup import arbitrate
from tailproof.reference.connector.meta import BoundaryPut, StoreJob
from tailproof.reference.connector.store import ScriptedStore, StoreRaised, check_script
from tailproof.reference.connector.tail import partial_tail_puts

FA, M = "full_attention", "mamba_align"


def _cfg(fa_bs: int, eagle: bool, h: int = 4, m_bs: int = 16) -> SimpleNamespace:
    groups = [SimpleNamespace(kind=FA, block_size=fa_bs, eagle=eagle),
              SimpleNamespace(kind=M, block_size=m_bs, eagle=False)]
    return SimpleNamespace(groups=groups, hash_block_size=h, num_blocks=64, enable_caching=True,
                           use_eagle=eagle, max_model_len=8192, max_num_scheduled_tokens=8192,
                           long_prefill_token_threshold=0)


@pytest.mark.parametrize(("fa_bs", "eagle", "prompt", "expected"), [
    (4, False, 45, [36, 40, 44]),
    (4, True, 49, [36, 40, 44, 48]),
    (16, False, 45, [44]),
    (16, True, 49, [48]),
    (8, True, 49, [40, 48]),
])
def test_attention_tail_puts_match_vllm(fa_bs: int, eagle: bool, prompt: int,
                                        expected: list[int]) -> None:
    """As vLLM 0.33's ``_partial_tail_non_mamba_puts`` answers: lcm 16, h 4, Mamba 16,
    checkpoint 44."""
    geo = StoreGeometry.from_config(_cfg(fa_bs, eagle))
    table = list(range(1, 20))
    job = StoreJob(req_id="r", token_len_chunk=0, block_ids=(table, [0, 0, 30]),
                  block_hashes=[b"x"] * 20, num_prompt_tokens=prompt, completed_token_len=prompt,
                  boundary_puts=[BoundaryPut(1, 30, 44)])
    puts = partial_tail_puts(geo, job)
    assert [p.num_tokens for p in puts] == expected
    assert all(p.group_id == 0 for p in puts)


def test_tail_puts_omitted_until_the_proof_is_computed() -> None:
    """register_finished_partial_tail with EAGLE: proof_end 48 > completed 44 -> no FA put."""
    geo = StoreGeometry.from_config(_cfg(16, True))
    job = StoreJob(req_id="r", token_len_chunk=0, block_ids=([1, 2, 3], [0, 0, 9]),
                  block_hashes=[b"x"] * 12, num_prompt_tokens=49, completed_token_len=44,
                  boundary_puts=[BoundaryPut(1, 9, 44)])
    assert partial_tail_puts(geo, job) == []


@pytest.mark.parametrize(("local", "ext", "expected"), [
    (20, 12, (16, 12, True)),  # remote 28 strictly beats local 20
    (20, 4, (20, 0, False)),  # remote 20 does not: keep the local tail
    (16, 8, (16, 8, False)),  # block-aligned local: take the remote tokens
    (16, 0, (16, 0, False)),
])
def test_remote_vs_local_arbitration(local: int, ext: int,
                                     expected: tuple[int, int, bool]) -> None:
    a = arbitrate(local, 16, ext, True)
    assert (a.local, a.external, a.truncated) == expected


def test_connector_config_defaults_and_errors() -> None:
    assert validate_connector_config({}) == {
        "role": "producer", "num_workers": 1, "save_decode_cache": False,
        "enable_lookup": True, "load_async": False}
    for bad, msg in [({"role": "kv_producer"}, "role"), ({"workers": 2}, "unknown"),
                     ({"num_workers": True}, "num_workers"), ({"num_workers": 0}, "1..8")]:
        with pytest.raises(ValueError, match=msg):
            validate_connector_config(bad)


def test_trace_loader_validates_the_connector_section() -> None:
    doc = {"format": FORMAT_TAG, "config": {
        "groups": [{"kind": FA, "block_size": 16}, {"kind": M, "block_size": 16}],
        "hash_block_size": 4, "num_blocks": 8, "connector": {"role": "nope"}}, "ops": []}
    with pytest.raises(TraceError, match="config.connector: role"):
        parse_trace(doc)
    doc["config"]["connector"] = {"num_workers": 2}
    assert parse_trace(doc).config.connector["num_workers"] == 2


def test_connector_ops_are_merged_into_the_vocabulary() -> None:
    specs = all_op_specs()
    assert set(CONNECTOR_OP_SPECS) <= set(specs)
    doc = {"format": FORMAT_TAG, "config": {
        "groups": [{"kind": FA, "block_size": 16}, {"kind": M, "block_size": 16}],
        "hash_block_size": 4, "num_blocks": 8},
        "ops": [{"op": "add_request", "rid": "A", "tokens": [1, 2, 3, 4]},
                {"op": "conn_step"}, {"op": "worker_run", "store": ["full"]},
                {"op": "store_lookup", "rid": "A"}]}
    ops = parse_trace(doc).ops
    assert ops[1] == {"op": "conn_step", "scheduled": None, "finished": [], "preempted": [],
                      "offer": []}
    doc["ops"].append({"op": "worker_run", "bogus": 1})
    with pytest.raises(TraceError, match="unknown field"):
        parse_trace(doc)


def test_scripted_store_outcomes() -> None:
    s = ScriptedStore()
    s.set_script(["full", ["ok", "error", -7], "raise"])
    assert s.put(["a"], ["ta"]) == [-200]
    assert s.put(["b", "c", "d", "e"], ["tb", "tc", "td", "te"]) == [0, -1, -7, 0]
    with pytest.raises(StoreRaised):
        s.put(["f"], ["tf"])
    assert s.put(["g"], ["tg"]) == [0]  # exhausted script: ok
    assert sorted(s.keys) == ["b", "e", "g"]
    assert s.batch_is_exist(["a", "b"]) == [0, 1]
    with pytest.raises(ValueError, match="entry 0"):
        check_script(["maybe"])
    with pytest.raises(ValueError, match="entry 0"):
        check_script([[True]])


class _Pool:
    """A pin pool that only counts (the reference's ``PinPool``)."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def touch_ids(self, ids: list[int]) -> None:
        self.held += ids

    def free_ids(self, ids: list[int]) -> None:
        for b in ids:
            self.held.remove(b)

    def take_ids(self, n: int) -> list[int]:
        raise AssertionError("no snapshot blocks in this test")

    def num_free(self) -> int:
        return 0


@pytest.mark.parametrize("readmitted", [True, False])
def test_preempted_and_readmitted_in_one_step_keeps_its_load(readmitted: bool) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts outside ``schedule()``; the
    next ``schedule()`` re-admits the request with an asynchronous load and reports it preempted
    in the same output. The reference issues that load (vLLM 0.33's ``build_connector_meta``
    drops it: the request would wait forever); a preemption reported with no admission since
    the last meta still drops the request's load spec and entry, as vLLM does."""
    from tailproof.reference.connector.config import ConnectorConfig
    from tailproof.reference.connector.meta import LoadSpec
    from tailproof.reference.connector.scheduler import ConnectorScheduler

    geo = StoreGeometry.from_config(_cfg(16, False))
    sched = ConnectorScheduler(ConnectorConfig(load_async=True), geo, _Pool())
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(50)), num_prompt_tokens=50,
                          num_computed_tokens=0, block_hashes=[bytes([i]) for i in range(12)])
    sched.load_specs["r"] = LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=44,
                                     can_load=False)
    sched.update_state_after_alloc(req, ([1, 2, 3], [0, 0, 9]), 44)
    rows = []
    if not readmitted:  # the admission's meta goes out first; the preemption comes a step later
        rows += sched.build_connector_meta([], set(), set(), {}, lambda rid: None)
    rows += sched.build_connector_meta([], set(), {"r"}, {}, lambda rid: None)
    loads = [(j.req_id, j.load_spec.kvpool_cached_tokens) for j in rows
             if j.load_spec is not None]
    assert loads == [("r", 44)]  # issued once, in the admission's meta
    assert ("r" in sched.unfinished_requests) == readmitted


@pytest.mark.parametrize(("vllm", "offset", "pressure"), [("0.33", 16, False),
                                                          ("0.34", None, True)])
def test_missing_source_block_keeps_the_offset_on_034(vllm: str, offset: int | None,
                                                      pressure: bool) -> None:
    """A normal save whose FA source block 1 is null puts block 0's key. vLLM 0.33 counts the
    save complete (offset 16, the pressure gate cleared); 0.34 records nothing and keeps the
    gate (``_handle_request`` / ``_record_saved_offset``: the range is retried)."""
    from tailproof.reference.connector.worker import SendingWorker
    from tailproof.reference.releases import RELEASES

    geo = StoreGeometry.from_config(_cfg(8, False, h=4, m_bs=16))
    w = SendingWorker(0, geo, ScriptedStore(), RELEASES[vllm])
    w.store_pressure_active = True
    job = StoreJob(req_id="r", token_len_chunk=16, block_ids=([5, 0], [0]),
                   block_hashes=[bytes([i]) for i in range(4)], num_prompt_tokens=20,
                   completed_token_len=16, store_job_id=0)
    w.add_request(job)
    ((_, first, err),) = w.run(None)
    assert err is None and len(w.store.log) - first == 1  # block 0's key, one batch
    assert w.saved_offset.get("r") == offset
    assert w.store_pressure_active is pressure
