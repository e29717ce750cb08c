"""The partial tail drawn in ``spec.arithmetic.partial_tail_puts`` and docs/glossary.md is what
the functions compute: ck(P), the scheduler-block floor, the tail put range and its keys, with
and without EAGLE (vLLM's own example, ``_partial_tail_non_mamba_puts``)."""

from __future__ import annotations

from tailproof.spec.arithmetic import (
    checkpoint_position,
    eagle_proof_margin,
    partial_tail_puts,
    round_down,
    tail_put_range,
)

H, ATTN, MAMBA, LCM = 4, 4, 16, 16
TABLE = [100 + i for i in range(12)]  # b0..b11 as block ids 100..111


def puts(prompt: int, eagle: bool) -> list[tuple[int, int]]:
    margin = eagle_proof_margin(ATTN, H, False) if eagle else 0
    out = partial_tail_puts(
        num_prompt_tokens=prompt, completed_token_len=prompt, num_hashes=prompt // H,
        publish_partial_tail=True, mamba_tail_boundaries=[], block_ids=(TABLE, [0, 0, 7]),
        block_sizes=(ATTN, MAMBA), is_mamba=(False, True), eagle_margins=(margin, 0),
        hash_block_size=H, scheduler_block_size=LCM, use_eagle=eagle)
    return [(block - 100, key) for _, block, key in out]


def test_the_drawn_tail() -> None:
    assert checkpoint_position(45, H, False) == 44  # ck(P)
    assert round_down(44, LCM) == 32  # the scheduler-block floor: normal saves stop there
    assert tail_put_range(44, LCM, ATTN, 0) == (8, 11)
    assert puts(45, eagle=False) == [(8, 36), (9, 40), (10, 44)]


def test_the_drawn_eagle_tail() -> None:
    assert checkpoint_position(49, H, True) == 44  # one h below the floor of P
    assert eagle_proof_margin(ATTN, H, False) == 4
    assert puts(49, eagle=True) == [(8, 36), (9, 40), (10, 44), (11, 48)]  # proof end 48
