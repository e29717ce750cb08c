"""The reference model's pin DEVIATIONS (reference/connector/scheduler.py): readable pins
follow the ranks' reported offsets, the worker reads nothing below a job's pin floor, and the
pin budget skips a job without taking an id."""

from __future__ import annotations

from types import SimpleNamespace

from tailproof.reference.connector.config import ConnectorConfig, StoreGeometry
from tailproof.reference.connector.meta import RequestTracker, StoreJob
from tailproof.reference.connector.scheduler import ConnectorScheduler
from tailproof.reference.connector.store import ScriptedStore
from tailproof.reference.connector.worker import SendingWorker

FA_TABLE = list(range(1, 9))


class _Pool:
    def __init__(self) -> None:
        self.held: list[int] = []

    def touch_ids(self, ids: list[int]) -> None:
        self.held += ids

    def free_ids(self, ids: list[int]) -> None:
        for b in ids:
            self.held.remove(b)

    def take_ids(self, n: int) -> list[int]:
        raise AssertionError("no snapshot blocks here")

    def num_free(self) -> int:
        return 0


def _geo() -> StoreGeometry:
    groups = [SimpleNamespace(kind="full_attention", block_size=16, eagle=False),
              SimpleNamespace(kind="mamba_align", block_size=16, eagle=False)]
    return StoreGeometry.from_config(SimpleNamespace(
        groups=groups, hash_block_size=4, num_blocks=64, enable_caching=True, use_eagle=False,
        max_model_len=8192, max_num_scheduled_tokens=8192, long_prefill_token_threshold=0))


def _sched(**conf: object) -> ConnectorScheduler:
    s = ConnectorScheduler(ConnectorConfig(**conf), _geo(), _Pool(), num_blocks=64)
    s.request_trackers["A"] = RequestTracker(req_id="A", token_len=0,
                                             allocated_block_ids=([], []))
    return s


def _job(start: int, end: int, rid: str = "A") -> StoreJob:
    return StoreJob(req_id=rid, token_len_chunk=end, token_ids_start=start, can_save=True,
                   block_ids=(list(FA_TABLE), [0] * 8),
                   block_hashes=[bytes([i]) for i in range(32)], num_prompt_tokens=200,
                   completed_token_len=end)


def _pins(s: ConnectorScheduler, job: StoreJob) -> list[int]:
    s._reference_save_blocks([job])
    return s.held[job.store_job_id][0]


def test_vllm_rule_by_default_and_readable_pins_when_set() -> None:
    wide = _sched()
    j = _job(0, 16)
    _pins(wide, j)
    wide.update_connector_output({j.store_job_id: 1}, {j.store_job_id: 16})
    assert _pins(wide, _job(16, 32)) == FA_TABLE
    s = _sched(readable_pins=True)
    j0 = _job(0, 16)
    assert _pins(s, j0) == [1]
    s.update_connector_output({j0.store_job_id: 1}, {j0.store_job_id: 16})
    j1 = _job(16, 32)
    assert _pins(s, j1) == [2] and j1.pin_floor == 16
    s.update_connector_output({j1.store_job_id: 1}, {j1.store_job_id: 16})  # its put failed
    j2 = _job(32, 48)
    assert _pins(s, j2) == [2, 3] and j2.pin_floor == 16


def test_worker_reads_nothing_below_the_pin_floor() -> None:
    store = ScriptedStore()
    w = SendingWorker(0, _geo(), store)
    job = _job(16, 32)
    job.store_job_id, job.pin_floor = 7, 16
    w.add_request(job)
    w.run(None)  # the rank's offset is 0 < 16: no normal save
    assert store.log == [] and w.saved_offset == {}
    assert w.take_saved_offsets() == {7: 0} and w.take_completed_saves() == {7: 1}
    job2 = _job(16, 32)
    job2.store_job_id = 8  # pin floor 0: saves from 0
    w.add_request(job2)
    w.run(None)
    assert w.saved_offset == {"A": 32} and w.take_saved_offsets() == {8: 32}


def test_pin_budget_skips_without_an_id() -> None:
    s = _sched(pin_budget_fraction=0.1, readable_pins=True)  # int(0.1 * 63) = 6 blocks
    big = _job(0, 96)
    assert _pins(s, big) == FA_TABLE[:6]
    s.earlier_pins = 6  # the next step begins with big unreported (build_connector_meta)
    rows = [_job(96, 112, rid="B")]
    s._reference_save_blocks(rows)
    assert rows == [] and s.next_store_job_id == 1
    s.update_connector_output({big.store_job_id: 1}, {big.store_job_id: 96})
    s.earlier_pins = 0
    assert _pins(s, _job(96, 112)) == [7]  # within the budget once A's pins are released
    wide = _sched(pin_budget_fraction=0.1)
    first = _job(0, 16)  # vLLM's rule pins the whole table: 8 > 6, no backlog: taken
    assert _pins(wide, first) == FA_TABLE
    wide.earlier_pins = 8
    rows = [_job(16, 32)]
    wide._reference_save_blocks(rows)
    assert rows == [] and list(wide.held) == [first.store_job_id]
