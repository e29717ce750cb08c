"""The stand-ins for the native CPU ops of vLLM 0.34's standalone Model Runner V2 follow the
contracts of the GPU Model Runner V2 Triton kernels they mirror (``ops.py`` cites each), on
small cases worked by hand, and their schemas take what ``vllm/_cpu_ops.py`` passes (called
through the dispatcher, in a namespace of their own: the process's ``_C`` stays untouched)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tailproof.conformance.realengine import ops  # noqa: E402

PAD = ops.PAD_SLOT_ID


@pytest.fixture(scope="module")
def dispatched() -> Iterator[Any]:
    lib = torch.library.Library("tailproof_testbed_ops", "DEF")
    ops.define(lib)
    yield torch.ops.tailproof_testbed_ops
    del lib


def test_gather_block_table_copies_each_rows_blocks_and_zeroes_padding(dispatched: Any) -> None:
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    num_blocks = torch.tensor([2, 3, 1], dtype=torch.int32)
    out = torch.full((4, 3), -5, dtype=torch.int32)
    out[:3].zero_()  # CPUBlockTables.gather_block_tables zeroes the rows it passes
    dispatched.gather_block_table_cpu(table, out, torch.tensor([2, 0]), num_blocks, 3)
    # batch row 0 <- request 2 (1 block), row 1 <- request 0 (2 blocks), row 2 padding
    assert out.tolist() == [[7, 0, 0], [1, 2, 0], [0, 0, 0], [-5, -5, -5]]


def test_slot_mapping_per_token_dummy_rows_disabled_groups_and_padding(dispatched: Any) -> None:
    table = torch.tensor([[7, 9, 0], [1, 2, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    positions = torch.tensor([2, 3, 4, 0, 5, 6])
    idx = torch.tensor([0, -1, 1])  # row 1: a dummy request, owns no blocks
    slots = torch.full((9,), 99, dtype=torch.int64)
    dispatched.compute_slot_mapping_cpu(table, slots, idx, qsl, positions, 4, True, PAD)
    assert slots.tolist() == [7 * 4 + 2, 7 * 4 + 3, 9 * 4 + 0, PAD, 2 * 4 + 1, 2 * 4 + 2,
                              PAD, PAD, PAD]
    dispatched.compute_slot_mapping_cpu(table, slots, idx, qsl, positions, 4, False, PAD)
    assert slots.tolist() == [PAD] * 9  # a group without slot mapping (Mamba)


def test_prefill_inputs_only_for_prefilling_rows_with_lookahead(dispatched: Any) -> None:
    all_tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]], dtype=torch.int32)
    prefill_len = torch.tensor([5, 3], dtype=torch.int32)
    computed = torch.tensor([1, 3], dtype=torch.int32)  # request 1 is decoding
    input_ids = torch.full((4,), -1, dtype=torch.int32)
    nxt = torch.full((1, 2), -1, dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    dispatched.prepare_prefill_inputs_cpu(input_ids, nxt, torch.tensor([0, 1]), qsl,
                                          all_tokens, prefill_len, computed)
    assert input_ids.tolist() == [11, 12, -1, -1]  # request 0's tokens 1..2; row 1 untouched
    assert nxt.tolist() == [[13, -1]]  # the next prefill token after the chunk
    qsl = torch.tensor([0, 4], dtype=torch.int32)  # a chunk to the prefill's end
    dispatched.prepare_prefill_inputs_cpu(input_ids, nxt, torch.tensor([0]), qsl,
                                          all_tokens, prefill_len, computed)
    assert input_ids.tolist() == [11, 12, 13, 14] and nxt.tolist() == [[0, -1]]


def test_positions_and_seq_lens(dispatched: Any) -> None:
    computed = torch.tensor([0, 7, 2], dtype=torch.int32)
    pos = torch.full((5,), -1, dtype=torch.int64)
    seq_lens = torch.full((4,), -1, dtype=torch.int32)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    dispatched.prepare_pos_seq_lens_cpu(torch.tensor([1, 2]), qsl, computed, pos, seq_lens)
    assert pos.tolist() == [7, 2, 3, 4, -1]
    assert seq_lens.tolist() == [8, 5, 0, 0]


def test_combine_writes_the_last_sampled_token_past_the_prefill_only(dispatched: Any) -> None:
    input_ids = torch.tensor([50, 51, 52, 53, 54], dtype=torch.int32)
    last = torch.tensor([[7], [8], [9]], dtype=torch.int64)
    qsl = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    # row 0: request 2 decoding (seq 11 > prefill 10); row 1: request 0 mid-prefill;
    # row 2: request 1, the chunk ending exactly at its prefill (its logit: the prompt's last)
    seq_lens = torch.tensor([11, 6, 12], dtype=torch.int32)
    prefill_len = torch.tensor([20, 12, 10], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    draft = last[:, :0]
    idx = dispatched.combine_sampled_and_draft_tokens_cpu(
        input_ids, torch.tensor([2, 0, 1]), last, qsl, seq_lens, prefill_len, draft, cu, 3, 1)
    assert idx.tolist() == [0, 2, 4] and idx.dtype == torch.int64
    assert input_ids.tolist() == [9, 51, 52, 53, 54]


def test_post_update_appends_sampled_tokens_and_advances_counts(dispatched: Any) -> None:
    computed = torch.tensor([4, 9, 0], dtype=torch.int32)
    last = torch.zeros(3, 1, dtype=torch.int64)
    bins = torch.zeros(3, 6, dtype=torch.int32)
    sampled = torch.tensor([[5], [3], [2]], dtype=torch.int64)
    num_sampled = torch.tensor([1, 0, 1], dtype=torch.int32)  # row 1: a chunked prefill
    rejected = torch.zeros(3, dtype=torch.int32)
    qsl = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    all_tokens = torch.zeros(3, 12, dtype=torch.int32)
    total = torch.tensor([5, 12, 0], dtype=torch.int32)
    dispatched.post_update_cpu(torch.tensor([0, 1, -1]), computed, last, bins, sampled,
                               num_sampled, rejected, qsl, all_tokens, total)
    assert computed.tolist() == [5, 13, 0]  # + query length; row 2 (index -1) skipped
    assert last.view(-1).tolist() == [5, 0, 0] and total.tolist() == [6, 12, 0]
    assert all_tokens[0, 5] == 5 and bins[0, 5] == 1 and int(bins.sum()) == 1
    dispatched.post_update_cpu(torch.tensor([0]), computed, last, None, sampled[:1],
                               num_sampled[:1], rejected[:1], None, all_tokens, total)
    assert computed.tolist() == [5, 13, 0] and total.tolist() == [7, 12, 0]


def test_gumbel_sample_greedy_at_temperature_zero_seeded_otherwise(dispatched: Any) -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    temperature = torch.tensor([0.0, 1.0])
    seeds = torch.tensor([11, 12])
    pos = torch.tensor([3, 4, 5])
    idx = torch.tensor([0, 0, 1])

    def sample(p: torch.Tensor, drafting: bool = False) -> list[int]:
        return dispatched.gumbel_sample_cpu(logits, idx, temperature, seeds, p, True,
                                            drafting, False).tolist()

    a = sample(pos)
    assert a[:2] == [1, 0]  # greedy: the first maximum
    assert a == sample(pos)  # the noise is a function of (seed, position)
    draws = {sample(torch.tensor([3, 4, p]))[2] for p in range(40)}
    assert draws == {0, 1, 2}  # equal logits: every token drawn at some position
