"""Unit checks of the reference's building blocks against the vLLM 0.33 rules they mirror."""

from __future__ import annotations

import pytest

from tailproof.reference.block_pool import Block, BlockPool, FreeBlockQueue
from tailproof.reference.geometry import Geometry, GroupSpec
from tailproof.reference.hashing import extend_block_hashes, hash_block_tokens
from tailproof.reference.kv_manager import KVCacheManager
from tailproof.reference.managers import MambaAlignManager
from tailproof.reference.request import Request
from tailproof.reference.scheduler_split import mamba_block_aligned_split, plan_chunk

FA, MA = "full_attention", "mamba_align"


def geo(groups: list[tuple[str, int]], h: int, **kw: object) -> Geometry:
    return Geometry(groups=tuple(GroupSpec(k, b) for k, b in groups), hash_block_size=h,
                    num_blocks=kw.pop("num_blocks", 24), **kw)


# --- free queue and pool --------------------------------------------------------------

def test_free_queue_discipline() -> None:
    pool = BlockPool(8, True, 2)
    q = pool.free_block_queue
    assert q.block_ids() == [1, 2, 3, 4, 5, 6, 7]  # block 0 is the null block
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    # Hashed blocks go to the tail, unhashed to the front, each in the given order.
    a[0].block_hash = (0, 2, b"x")
    pool.free_blocks([a[0], a[1], a[2]])
    assert q.block_ids() == [2, 3, 4, 5, 6, 7, 1]
    pool.touch([pool.blocks[5]])
    assert q.block_ids() == [2, 3, 4, 6, 7, 1]
    q2 = FreeBlockQueue([pool.blocks[i] for i in (1, 2)])
    q2.prepend_n([pool.blocks[4], pool.blocks[3]])
    assert q2.block_ids() == [4, 3, 1, 2]


def test_get_new_blocks_raises_when_short() -> None:
    pool = BlockPool(3, True, 2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_partial_key_survives_promotion_as_secondary() -> None:
    # FA bs4, h2, P=7: the partial entry @6 is registered, then the block fills (full @8)
    # and keeps @6 as a secondary key (vLLM 0.33's ``BlockPool._insert_block_hash``).
    m = KVCacheManager(geo([(FA, 4), (MA, 4)], 2))
    r = Request("a", [0, 0, 1, 1, 2, 2, 9], 2)
    assert m.allocate_slots(r, 7) is not None
    r.num_computed_tokens = 7
    fa_block = m.get_blocks("a")[0][1]
    assert fa_block.block_hash_num_tokens == 6
    r.append_output_token_ids([4])
    assert m.allocate_slots(r, 1) is not None
    assert fa_block.block_hash_num_tokens == 8
    assert sorted(k[:2] for k in m.block_pool.cached_block_hashes_by_block[fa_block.block_id]) \
        == [(0, 6)]


def test_reset_needs_every_block_free() -> None:
    m = KVCacheManager(geo([(FA, 2)], 2))
    r = Request("a", [1, 2, 3, 4], 2)
    m.allocate_slots(r, 4)
    assert m.reset_prefix_cache() is False
    m.free(r)
    assert m.block_pool.keys()
    assert m.reset_prefix_cache() is True
    assert m.block_pool.keys() == []


# --- hashing --------------------------------------------------------------------------

def test_hash_chain_identifies_prefixes() -> None:
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, [1, 2, 3, 4, 5], 2)
    extend_block_hashes(b, [1, 2, 3, 9], 2)
    assert len(a) == 2 and len(b) == 2  # only full h-units
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def test_request_hashes_grow_with_output() -> None:
    r = Request("a", [1, 2, 3], 2)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(4)
    assert len(r.block_hashes) == 2


# --- geometry -------------------------------------------------------------------------

def test_geometry_derivations() -> None:
    g = geo([(FA, 2), (MA, 4)], 2)
    assert (g.scheduler_block_size, g.partial_hits, g.alignment) == (4, True, 2)
    g = geo([(FA, 4), (MA, 4)], 4)
    assert (g.partial_hits, g.alignment) == (False, 4)  # Mamba block == h: no partial hits
    g = geo([(FA, 4)], 4)
    assert g.coordinator_kind == "unitary"
    with pytest.raises(ValueError):
        geo([(FA, 4)], 2)  # unitary needs h == block size
    g = Geometry(groups=(GroupSpec(FA, 4, eagle=True), GroupSpec(MA, 8)), hash_block_size=4,
                 num_blocks=8, use_eagle=True)
    assert g.drop_eagle_group_ids == {0} and g.manager_use_eagle == (True, False)
    g = Geometry(groups=(GroupSpec(FA, 4), GroupSpec(MA, 8)), hash_block_size=4,
                 num_blocks=8, use_eagle=True)
    assert g.drop_eagle_group_ids == {0, 1}  # none flagged: all groups


# --- scheduler split (upstream tests T1-T4, docs/citations.md) --------------------------

def _chunks(g: Geometry, prompt_len: int, start: int = 0, budget: int | None = None) -> list[int]:
    r = Request("r", [0] * prompt_len, g.hash_block_size)
    r.num_computed_tokens = start
    out = []
    while r.num_computed_tokens < prompt_len:
        want = min(prompt_len - r.num_computed_tokens, budget or g.max_num_scheduled_tokens)
        if g.long_prefill_token_threshold:
            want = min(want, g.long_prefill_token_threshold)
        n = mamba_block_aligned_split(g, r, want)
        assert n > 0
        out.append(n)
        r.num_computed_tokens += n
    return out


def test_split_t1_partial_tail_schedule() -> None:
    g = geo([(FA, 512), (MA, 512)], 32)
    assert _chunks(g, 10000) == [8192, 1536, 256, 16]
    g_off = geo([(FA, 512), (MA, 512)], 512)
    assert _chunks(g_off, 10000, start=9728) == [272]


def test_split_t2_block_exceeds_budget() -> None:
    g = geo([(FA, 11392), (MA, 11392)], 11392)
    assert _chunks(g, 30000) == [8192, 3200, 8192, 3200, 7216]


def test_split_t3_long_prefill_threshold() -> None:
    g = geo([(FA, 512), (MA, 512)], 512, long_prefill_token_threshold=384)
    assert _chunks(g, 1300) == [384, 128, 384, 128, 276]


def test_split_t4_stops_below_eagle_proof_boundary() -> None:
    g = geo([(FA, 1536), (MA, 1536)], 128, use_eagle=True)
    for prompt_len in (24576, 24577):
        r = Request("r", [0] * prompt_len, 128)
        r.num_computed_tokens = 23040
        assert 23040 + mamba_block_aligned_split(g, r, prompt_len - 23040) == 24448


def test_split_c_series_chunk_ends() -> None:
    # the chunk ends vLLM 0.33's ``Scheduler._mamba_block_aligned_split`` gives.
    cases = [((16, 4), 13, [12, 13]), ((16, 4), 16, [12, 16]), ((16, 4), 45, [32, 44, 45]),
             ((16, 4), 12, [8, 12]), ((4, 2), 7, [4, 6, 7]), ((4, 2), 6, [4, 6])]
    for (bs, h), p, ends in cases:
        g = geo([(FA, bs), (MA, bs)], h)
        got = _chunks(g, p)
        assert [sum(got[: i + 1]) for i in range(len(got))] == ends, (bs, h, p)


def _junction_geo(flag: bool, eagle: bool, h: int = 16) -> Geometry:
    return Geometry(groups=(GroupSpec(FA, 1024), GroupSpec(MA, 1024, eagle)), hash_block_size=h,
                    num_blocks=24, enable_mamba_shared_prefix_checkpoint=flag)


def test_junction_flag_takes_effect_only_with_eagle_and_partial_hits() -> None:
    # KVCacheManager.__init__: flag and an EAGLE group and partial hits (no MTP re-prefill).
    assert _junction_geo(True, True).mamba_shared_prefix_checkpoint
    assert not _junction_geo(True, False).mamba_shared_prefix_checkpoint
    assert not _junction_geo(False, True).mamba_shared_prefix_checkpoint
    assert not _junction_geo(True, True, h=1024).mamba_shared_prefix_checkpoint


def test_split_stops_at_junction_block_floored_or_exact() -> None:
    # Scheduler._mamba_block_aligned_split: a 4,500-token prompt whose first 4,000 tokens are
    # cached by attention only (junction 4000). Without the effective flag the stop is the
    # junction floored to the Mamba block from the chunk start; with it, the junction itself.
    def first_chunk(g: Geometry, junction: int, start: int = 0) -> int:
        r = Request("r", list(range(4500)), 16)
        r.num_computed_tokens = start
        r.shared_prefix_boundary = junction
        return start + mamba_block_aligned_split(g, r, 4500 - start)

    off, on = _junction_geo(False, False), _junction_geo(True, True)
    assert first_chunk(off, 0) == 4096  # no junction: the last cacheable block boundary
    assert first_chunk(off, 4000) == 3072
    assert first_chunk(_junction_geo(True, False), 4000) == 3072  # flag narrowed away
    assert first_chunk(on, 4000) == 4000
    assert first_chunk(on, 3072) == 3072  # on the grid: the same stop either way
    assert first_chunk(off, 4000, start=1024) == 3072  # floored from the chunk start
    assert first_chunk(on, 4000, start=1024) == 4000
    # A junction past the prompt (a resumed request replaying output): block-floored even
    # with the flag, since the manager keys nothing past the prompt.
    r = Request("r", list(range(4500)), 16)
    r.num_prompt_tokens = 3500
    r.shared_prefix_boundary = 4000
    assert mamba_block_aligned_split(on, r, 4500) == 3072


def test_no_split_without_mamba() -> None:
    g = geo([(FA, 4), (FA, 8)], 4)
    assert plan_chunk(g, Request("r", [0] * 30, 4), 30) == 30


# --- truncate -------------------------------------------------------------------------

def test_truncate_is_pure_and_checks_alignment() -> None:
    m = KVCacheManager(geo([(FA, 2), (MA, 4)], 2))
    null = m.block_pool.null_block
    b1, b2, b3 = m.block_pool.blocks[1:4]
    blocks = [[b1, b2, b3], [null, b3]]
    assert m.truncate_computed_blocks(blocks, 4) == [[b1, b2], [null]]
    assert m.truncate_computed_blocks([[b1, b2, b3], []], 4) == [[b1, b2], []]
    assert blocks == [[b1, b2, b3], [null, b3]]
    with pytest.raises(AssertionError):
        m.truncate_computed_blocks(blocks, 6)  # not a Mamba block multiple
    with pytest.raises(AssertionError):
        m.truncate_computed_blocks([[b1], [null, b3]], 4)  # FA too short


# --- Mamba speculative blocks (MambaSpec.num_speculative_blocks) -----------------------

def _spec_manager(num_spec: int) -> tuple[BlockPool, MambaAlignManager]:
    pool = BlockPool(16, True, 4)
    return pool, MambaAlignManager(8, pool, 1, True, 8, num_speculative_blocks=num_spec)


def _ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def test_spec_blocks_first_allocation_is_capped_at_one_plus_s() -> None:
    """MambaManager.get_num_blocks_to_allocate: cdiv(n, B) + S blocks are required, and a
    request's first allocation is capped at 1 + S (the skipped states become null)."""
    _, m = _spec_manager(2)
    assert m.get_num_blocks_to_allocate("a", 16, [], 0, 0, 16) == 3
    new = m.allocate_new_blocks("a", 16, 16)
    # null (the skipped state), the running state, 2 scratch blocks; all reported as new
    assert _ids(m.req_to_blocks["a"]) == _ids(new) == [0, 1, 2, 3]
    # Running: one new block at most, whatever the chunk passes.
    assert m.get_num_blocks_to_allocate("a", 40, [], 16, 16, 40) == 1


def test_spec_blocks_passed_by_a_chunk_move_behind_nulls() -> None:
    """MambaManager.allocate_new_blocks: the running state before the chunk is recorded at
    len - 1 - S; the scratch blocks the chunk passes move to the end of the table
    (_relocate_speculative_block) and their entries become null."""
    pool, m = _spec_manager(2)
    m.allocate_new_blocks("a", 16, 16)
    null, running, s1, s2 = m.req_to_blocks["a"]
    new = m.allocate_new_blocks("a", 32, 32)
    assert m.last_state_block_idx["a"] == 1  # prev_len 4 - 1 - S
    # s1 is passed: moved to the end (reported again), s2 holds the running state at 32.
    assert new[0] is s1 and len(new) == 2 and new[1].ref_cnt == 1
    assert m.req_to_blocks["a"] == [null, running, pool.null_block, s2, *new]
    # The previous running state is freed once the computed tokens pass it.
    m.remove_skipped_blocks("a", 32)
    assert m.req_to_blocks["a"][1] is pool.null_block and running.ref_cnt == 0
    # A one-block step moves nothing: the first scratch block holds the running state.
    new2 = m.allocate_new_blocks("a", 40, 40)
    assert len(new2) == 1 and m.req_to_blocks["a"][4:] == [*new, *new2]
    assert m.last_state_block_idx["a"] == 3


def test_spec_block_relocation_needs_a_private_unkeyed_block() -> None:
    _, m = _spec_manager(1)
    m.allocate_new_blocks("a", 8, 8)
    m.req_to_blocks["a"][1].ref_cnt += 1  # shared: no longer the request's scratch block
    with pytest.raises(AssertionError, match="exclusively owned"):
        m.allocate_new_blocks("a", 24, 24)


def test_spec_blocks_only_on_mamba_groups() -> None:
    with pytest.raises(ValueError, match="only Mamba groups"):
        Geometry(groups=(GroupSpec(FA, 8, num_speculative_blocks=1),), hash_block_size=8,
                 num_blocks=8)
