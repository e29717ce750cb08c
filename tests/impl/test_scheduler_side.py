"""Scheduler role in isolation: attention tail puts, pins, failed loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from stub_pool import Pool

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import BoundaryPut, SaveDraft, TailproofWorkerMeta
from tailproof.impl.scheduler_side import SchedulerSide


def side(fa_bs: int, eagle: bool, workers: int = 1) -> SchedulerSide:
    g = StoreGeometry(core_group_ids=(0, 1), block_sizes=(fa_bs, 16), is_mamba=(False, True),
                 hash_block_size=4, scheduler_block_size=16, partial_hits=True, use_eagle=eagle,
                      eagle_group_ids=frozenset({0, 1}) if eagle else frozenset(),
                      num_blocks=64)
    return SchedulerSide(Settings(), g, None, workers)


@pytest.mark.parametrize(("fa_bs", "eagle", "prompt", "want"), [
    (4, False, 45, [(9, 36), (10, 40), (11, 44)]),
    (4, True, 49, [(9, 36), (10, 40), (11, 44), (12, 48)]),
    (16, False, 45, [(3, 44)]),
    (16, True, 49, [(3, 48)]),
    (8, True, 49, [(5, 40), (6, 48)]),
])
def test_attention_tail_puts_match_vllm(fa_bs: int, eagle: bool, prompt: int,
                                        want: list[tuple[int, int]]) -> None:
    """The vLLM 0.33 results of ``_partial_tail_non_mamba_puts``: lcm 16, h 4,
    Mamba 16, checkpoint 44; block ids are table index + 1."""
    s = side(fa_bs, eagle)
    table = list(range(1, 64 // fa_bs + 1))
    save = SaveDraft(req_id="r", token_len_chunk=0, block_ids=(table, [0, 0, 30]),
                     block_hashes=[b"x"] * 16, boundary_puts=[BoundaryPut(1, 30, 44)],
                     completed_token_len=49, num_prompt_tokens=prompt)
    got = s.partial_tail_puts(save)
    assert [(p.block_id, p.num_tokens) for p in got if p.group_id == 0] == want


def test_tail_puts_skip_null_and_unfinished_proof() -> None:
    s = side(4, True)
    table = [1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12]
    save = SaveDraft(req_id="r", token_len_chunk=0, block_ids=(table, [0, 0, 30]),
                     block_hashes=[b"x"] * 16, boundary_puts=[BoundaryPut(1, 30, 44)],
                     completed_token_len=47, num_prompt_tokens=49)
    assert s.partial_tail_puts(save) == []  # proof end 48 not computed yet
    save.completed_token_len = 49
    assert [p.block_id for p in s.partial_tail_puts(save)] == [10, 11, 12]  # null block 9 skipped


def test_pins_released_once_after_every_worker() -> None:
    s = side(16, False, workers=2)
    pool = Pool()
    s.bind_gpu_block_pool(pool)
    job = s._take_pins([5, 6])
    assert pool.blocks[5].ref_cnt == 1 and s.held[job] == ([5, 6], 2)
    s.update_connector_output(TailproofWorkerMeta(completed_saves={job: 1}))
    assert pool.blocks[5].ref_cnt == 1 and s.has_pending_push_work()
    s.update_connector_output(TailproofWorkerMeta(completed_saves={job: 1}))
    assert pool.blocks[5].ref_cnt == 0 and not s.has_pending_push_work()
    s.update_connector_output(TailproofWorkerMeta(completed_saves={job: 1}))  # unknown: ignored
    job2 = s._take_pins([7])
    with pytest.raises(AssertionError, match="too many"):
        s.update_connector_output(TailproofWorkerMeta(completed_saves={job2: 3}))
    with pytest.raises(AssertionError, match="null"):
        s._take_pins([0])


def test_failed_load_is_not_offered_again() -> None:
    from tailproof.impl.lookup import LookupResult
    from tailproof.impl.meta import TailKeyBoundary

    s = side(16, False)
    hit = LookupResult(32, (TailKeyBoundary(0, 32), TailKeyBoundary(1, 32)))
    s.lookup_client = SimpleNamespace(lookup=lambda n, h: hit)
    req = SimpleNamespace(request_id="r", num_tokens=45, block_hashes=[b"x"] * 11)
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)
    s.update_connector_output(None, failed_recving={"r"})
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.build_connector_meta(SimpleNamespace(
        finished_req_ids={"r"}, preempted_req_ids=set(), scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={}, kv_connector_block_state=None))
    assert s.get_num_new_matched_tokens(req, 0) == (32, True)
