"""Readable pins and the pin budget on the scheduler role (reference/connector/scheduler.py,
DEVIATIONS): a normal save pins only what a rank can still read; store-job pins stay within
``pin_budget_fraction`` of the pool."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from stub_pool import Pool

from tailproof.impl.config import ConfigError, Settings, StoreGeometry, parse_settings
from tailproof.impl.keys import KeyEpoch
from tailproof.impl.lookup import StoreLookup
from tailproof.impl.meta import BoundaryPut, SaveDraft, StoreJob, TailproofWorkerMeta
from tailproof.impl.scheduler_side import RequestTracker, SchedulerSide

FA_TABLE = list(range(1, 9))  # FA16 blocks of a 128-token prompt
MAMBA_TABLE = list(range(20, 28))


def side(workers: int = 1, **settings: object) -> SchedulerSide:
    g = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                      hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                      use_eagle=False, num_blocks=64)
    s = SchedulerSide(replace(Settings(), **settings), g, None, workers)
    s.bind_gpu_block_pool(Pool())
    s.request_trackers["A"] = RequestTracker(req_id="A", token_len=0,
                                             allocated_block_ids=([], []))
    return s


def save(start: int, end: int, rid: str = "A") -> SaveDraft:
    return SaveDraft(req_id=rid, token_len_chunk=end, token_ids_start=start,
                    block_ids=(list(FA_TABLE), list(MAMBA_TABLE)), block_hashes=[b"x"] * 32,
                    num_prompt_tokens=200)


def sealed(s: SchedulerSide, draft: SaveDraft) -> StoreJob:
    job = s.seal(draft)
    assert job is not None
    return job


def pins(s: SchedulerSide, job: StoreJob) -> list[int]:
    return s.held[job.store_job_id][0]


def report(s: SchedulerSide, job: StoreJob, offset: int, ranks: int = 1) -> None:
    s.update_connector_output(TailproofWorkerMeta(
        completed_saves={job.store_job_id: ranks}, saved_offsets={job.store_job_id: offset}))


def test_vllm_rule_pins_the_whole_table() -> None:
    s = side(readable_pins=False)
    j0 = sealed(s, save(0, 16))
    assert pins(s, j0) == FA_TABLE and j0.pin_floor == 0
    report(s, j0, 16)
    assert pins(s, sealed(s, save(16, 32))) == FA_TABLE


def test_readable_pins_follow_the_reported_offset() -> None:
    s = side()
    j0 = sealed(s, save(0, 16))
    assert pins(s, j0) == [1]
    j1 = sealed(s, save(16, 32))  # built before j0 was reported: from 0
    assert pins(s, j1) == [1, 2] and j1.pin_floor == 0
    report(s, j0, 16)
    report(s, j1, 32)
    j2 = sealed(s, save(32, 48))
    assert pins(s, j2) == [3] and j2.pin_floor == 32


def test_a_block_both_a_tail_put_and_in_the_table_is_pinned_once() -> None:
    """An aligned prompt (48 = 3 FA blocks, ck = 44): the tail's attention block 3 is also in
    the save's slice; the Mamba state block is in no attention table (no dedup needed)."""
    s = side()
    j = sealed(s, SaveDraft(req_id="A", token_len_chunk=48, token_ids_start=0,
                            block_ids=(list(FA_TABLE), list(MAMBA_TABLE)),
                            block_hashes=[b"x"] * 32, num_prompt_tokens=48,
                            completed_token_len=48, publish_partial_tail=True,
                            boundary_puts=[BoundaryPut(1, 22, 44)]))
    assert pins(s, j) == [3, 22, 1, 2]  # tail put, hand-off, then the table: each once
    assert [s.pool.blocks[b].ref_cnt for b in (1, 2, 3, 22)] == [1, 1, 1, 1]
    d1 = save(48, 64)  # a plain save: its hand-off and its slice, no tail
    d1.boundary_puts = [BoundaryPut(1, 23, 64)]
    assert pins(s, sealed(s, d1)) == [23, 1, 2, 3, 4]


def test_a_sealed_job_is_frozen_with_its_id_and_epoch() -> None:
    """The seal is the one place a job gets its puts, pins, id and epoch; the draft is left
    as it was and the job cannot be changed after."""
    s = side()
    s.move_epoch("e7")
    d = SaveDraft(req_id="A", token_len_chunk=48, block_ids=(list(FA_TABLE), list(MAMBA_TABLE)),
                  block_hashes=[b"x"] * 32, num_prompt_tokens=48, completed_token_len=48,
                  publish_partial_tail=True, boundary_puts=[BoundaryPut(1, 22, 44)])
    j = sealed(s, d)
    assert (j.store_job_id, j.epoch) == (0, "e7") and s.next_store_job_id == 1
    assert j.boundary_puts == (BoundaryPut(0, 3, 44), BoundaryPut(1, 22, 44))
    assert d.boundary_puts == [BoundaryPut(1, 22, 44)]  # the tail put went to the job only
    field = "epoch"
    with pytest.raises(AttributeError):
        setattr(j, field, "e8")


def test_the_seal_carries_every_field_of_the_draft() -> None:
    """``seal`` builds the job positionally (the hot path): each field lands where it should."""
    s = side(readable_pins=False)
    s.move_epoch("e3")
    d = SaveDraft(req_id="A", token_len_chunk=32, block_ids=(list(FA_TABLE), list(MAMBA_TABLE)),
                  block_hashes=[b"y"] * 9, boundary_puts=[BoundaryPut(1, 21, 32)],
                  token_ids_start=16, publish_partial_tail=False, completed_token_len=33,
                  num_prompt_tokens=200, prefill_end_tokens=190)
    j = sealed(s, d)
    assert j._asdict() == {
        "store_job_id": 0, "req_id": "A", "token_len_chunk": 32, "block_ids": d.block_ids,
        "block_hashes": d.block_hashes, "boundary_puts": (BoundaryPut(1, 21, 32),),
        "token_ids_start": 16, "publish_partial_tail": False, "completed_token_len": 33,
        "num_prompt_tokens": 200, "prefill_end_tokens": 190, "epoch": "e3", "pin_floor": 0}


def test_a_failed_put_widens_the_next_pins() -> None:
    s = side()
    j0 = sealed(s, save(0, 16))
    report(s, j0, 0)  # the rank's put failed: its offset stayed 0
    j1 = sealed(s, save(16, 32))
    assert pins(s, j1) == [1, 2] and j1.pin_floor == 0


def test_the_lowest_rank_counts_and_a_partial_report_confirms_nothing() -> None:
    s = side(workers=2)
    j0 = sealed(s, save(0, 16))
    report(s, j0, 16)  # rank 0 only
    assert pins(s, sealed(s, save(16, 32))) == [1, 2]
    s.update_connector_output(TailproofWorkerMeta(completed_saves={j0.store_job_id: 1},
                                                  saved_offsets={j0.store_job_id: 0}))
    assert pins(s, sealed(s, save(32, 48))) == [1, 2, 3]  # rank 1 lags at 0


def test_a_report_without_offsets_confirms_nothing() -> None:
    s = side()
    j0 = sealed(s, save(0, 16))
    s.update_connector_output(TailproofWorkerMeta(completed_saves={j0.store_job_id: 1}))
    assert pins(s, sealed(s, save(16, 32))) == [1, 2]


def test_a_job_of_an_earlier_life_confirms_nothing() -> None:
    s = side()
    j0 = sealed(s, save(0, 16))
    s.request_trackers["A"].reset()  # preempted: the ranks drop their offsets
    report(s, j0, 16)
    j1 = sealed(s, save(0, 16))
    assert pins(s, j1) == [1] and j1.pin_floor == 0
    assert s.request_trackers["A"].confirmed == (-1, 0)


def test_worker_meta_aggregates_the_lowest_offset() -> None:
    a = TailproofWorkerMeta(completed_saves={3: 1}, saved_offsets={3: 32})
    a.aggregate(TailproofWorkerMeta(completed_saves={3: 1, 4: 1}, saved_offsets={3: 16, 4: 8}))
    assert a.completed_saves == {3: 2, 4: 1} and a.saved_offsets == {3: 16, 4: 8}


def new_step(s: SchedulerSide) -> None:
    """What ``build_connector_meta`` notes first: the pins earlier steps' jobs still hold."""
    s._earlier_pins = s.metrics.pinned_blocks


def test_pin_budget_skips_a_job_and_counts_it() -> None:
    s = side(pin_budget_fraction=0.1)  # int(0.1 * 63) = 6 blocks
    assert s._pin_budget == 6
    big = sealed(s, save(0, 96))  # FA blocks 1-6
    assert pins(s, big) == FA_TABLE[:6]
    new_step(s)  # big's senders lag: its 6 pins are the backlog
    before = s.next_store_job_id
    assert s.seal(save(96, 112, rid="B")) is None
    assert s.metrics.c.total("jobs_skipped_pin_budget") == 1
    assert s.next_store_job_id == before  # no id was taken by the skip
    report(s, big, 96)
    new_step(s)
    ok = sealed(s, save(96, 112))
    assert pins(s, ok) == [7] and ok.store_job_id == before


def test_pin_budget_skips_a_finish_time_tail() -> None:
    s = side(pin_budget_fraction=0.02)  # 1 block
    held = sealed(s, save(0, 16, rid="B"))
    assert pins(s, held) == FA_TABLE  # no tracker: the whole table; no backlog: taken
    new_step(s)
    s.request_trackers["A"].prefill_end_tokens = 40
    req = SimpleNamespace(request_id="A", block_hashes=[b"x"] * 10, num_computed_tokens=40,
                          num_prompt_tokens=41)
    tables = (list(FA_TABLE[:3]), [0, 0, 30])
    s.register_finished_partial_tail(req, tables, [(1, 30, 40)])
    assert "A" not in s.finished_partial_tails  # backlog 8 + tail block 3 + Mamba 30 > 1
    assert s.metrics.c.total("jobs_skipped_pin_budget") == 1
    assert list(s.held) == [held.store_job_id]
    report(s, held, 16)
    new_step(s)
    s.move_epoch("e1")
    s.register_finished_partial_tail(req, tables, [(1, 30, 40)])
    assert "A" in s.finished_partial_tails  # no backlog: taken
    s.move_epoch("e2")  # a reset before the next meta: the job keeps its finish-time epoch
    assert s.finished_partial_tails["A"].epoch == "e1"


def test_a_steps_own_jobs_are_not_skipped() -> None:
    s = side(pin_budget_fraction=0.02)  # 1 block
    d = save(0, 16)
    d.boundary_puts = [BoundaryPut(1, 20, 16)]
    assert pins(s, sealed(s, d)) == [20, 1]
    assert pins(s, sealed(s, save(16, 32))) == [1, 2]  # same step: no backlog from earlier
    new_step(s)
    assert s.seal(save(32, 48)) is None and s.metrics.c.total("jobs_skipped_pin_budget") == 1


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "half"])
def test_pin_budget_fraction_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="pin_budget_fraction must be a number in"):
        parse_settings({"pin_budget_fraction": bad}, "kv_both")


def test_pin_settings_parse() -> None:
    s = parse_settings({"pin_budget_fraction": None, "readable_pins": False}, "kv_both")
    assert s.pin_budget_fraction is None and not s.readable_pins
    d = parse_settings({}, "kv_both")
    assert d.readable_pins and d.pin_budget_fraction == 0.25


def test_the_scheduler_role_owns_the_key_epoch() -> None:
    """One owner (issue 23): a reset moves the epoch the lookup client reads, too."""
    lk = StoreLookup.__new__(StoreLookup)  # only its epoch is read here
    lk.key_epoch = KeyEpoch()
    s = SchedulerSide(Settings(), side().geo, lk, 1)
    s.move_epoch("e1")
    assert s.epoch == lk.epoch == "e1" and s.key_epoch is lk.key_epoch
