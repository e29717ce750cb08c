"""A CPU (or CUDA) stand-in for vLLM's model runner, for the ``impl`` adapter and tests.

It lives in the harness, not in ``tailproof.impl``: the ``impl`` adapter needs it whenever the
corpus replays on it (``tailproof replay --against impl``), and production never imports it.

Why: to check the connector's data path byte for byte without a GPU or a model. Every forward
write fills KV with bytes *derived from (rank, layer, group, token prefix)*: a full-attention slot
at position p holds ``content(prefix[:p+1])``, a Mamba state block after n tokens holds
``content(prefix[:n])``. A load is then correct iff every loaded slot / state equals what its
prefix must be -- reading a CoW source instead of its target, a stale or reused block, or an
off-by-one offset all show up as a byte mismatch.

Layouts mirror vLLM's: full attention ``(2, num_blocks, block_size, heads, head_size)``
(FlashAttention, block dim 1), Mamba ``[conv (num_blocks, c), ssm (num_blocks, s)]`` (block dim 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tailproof.spec.arithmetic import cdiv


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def content(n: int, seed: bytes) -> torch.Tensor:
    """``n`` float32 values, a deterministic function of ``seed`` (finite, no NaN patterns)."""
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") & ((1 << 63) - 1))
    return torch.rand(n, generator=g, dtype=torch.float32)


@dataclass(frozen=True)
class GroupShape:
    """One KV cache group of the simulated model."""

    kind: str  # "full_attention" | "sliding_window" (an attention layout) | "mamba"
    block_size: int
    layers: int = 1


class PrefixDigests:
    """Running digests of a token sequence: ``at(n)`` identifies ``tokens[:n]``."""

    def __init__(self) -> None:
        self._d = [_digest("empty")]
        self._seen: list[int] = []

    def at(self, tokens: Sequence[int], n: int) -> bytes:
        k = min(len(self._seen), n)
        if list(tokens[:k]) != self._seen[:k]:  # another sequence under the same name
            self._d, self._seen = self._d[:1], []
        if n > len(self._seen):
            self._seen = list(tokens[:n])
        while len(self._d) <= n:
            i = len(self._d)
            self._d.append(_digest(self._d[-1], tokens[i - 1]))
        return self._d[n]


class SimRunner:
    """One worker's KV tensors plus a deterministic "forward" that fills them."""

    HEAD = 4  # floats per full-attention slot (per K and V)
    CONV, SSM = 3, 5  # floats per Mamba conv / ssm state

    def __init__(self, groups: Sequence[GroupShape], num_blocks: int, rank: int = 0,
                 device: str = "cpu"):
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.rank = rank
        self.kv: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        self.layer_names: list[list[str]] = []
        for g, gs in enumerate(self.groups):
            names = [f"g{g}.l{i}" for i in range(gs.layers)]
            self.layer_names.append(names)
            for name in names:
                if gs.kind == "mamba":
                    self.kv[name] = [
                        torch.zeros(num_blocks, self.CONV, device=device),
                        torch.zeros(num_blocks, self.SSM, device=device),
                    ]
                else:
                    self.kv[name] = torch.zeros(
                        2, num_blocks, gs.block_size, 1, self.HEAD, device=device)
        self._digests: dict[str, PrefixDigests] = {}

    # ------------------------------------------------------------------ expected content

    def _seed(self, rid: str, tokens: Sequence[int], n: int, layer: str) -> bytes:
        d = self._digests.setdefault(rid, PrefixDigests()).at(tokens, n)
        return _digest(self.rank, layer, d)

    def expected_slot(self, tokens: Sequence[int], p: int, layer: str, rid: str) -> torch.Tensor:
        """K/V of position p given the prefix ``tokens[:p+1]``: shape (2, HEAD)."""
        return content(2 * self.HEAD, self._seed(rid, tokens, p + 1, layer)).view(2, self.HEAD)

    def expected_state(self, tokens: Sequence[int], n: int, layer: str, rid: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba (conv, ssm) state after ``tokens[:n]``."""
        v = content(self.CONV + self.SSM, self._seed(rid, tokens, n, layer))
        return v[: self.CONV], v[self.CONV :]

    # ------------------------------------------------------------------ forward

    def forward(self, rid: str, tokens: Sequence[int], start: int, end: int,
                tables: Sequence[Sequence[int]]) -> None:
        """Compute ``tokens[start:end]`` of a request: fill its KV slots and final state."""
        for g, gs in enumerate(self.groups):
            table = tables[g]
            for name in self.layer_names[g]:
                if gs.kind == "mamba":
                    idx = cdiv(end, gs.block_size) - 1
                    if idx >= len(table) or table[idx] == 0:
                        continue  # no state block (bookkeeping-only traces)
                    blk = table[idx]
                    conv, ssm = self.expected_state(tokens, end, name, rid)
                    t = self.kv[name]
                    assert isinstance(t, list)
                    t[0][blk] = conv
                    t[1][blk] = ssm
                    continue
                t = self.kv[name]
                assert isinstance(t, torch.Tensor)
                for p in range(start, end):
                    if p // gs.block_size >= len(table) or table[p // gs.block_size] == 0:
                        continue  # no block holds this position (bookkeeping-only traces)
                    blk = table[p // gs.block_size]
                    t[:, blk, p % gs.block_size, 0, :] = self.expected_slot(tokens, p, name, rid)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply the step's CoW copies (src -> dst) to every layer (a page is one block id)."""
        for src, dst in copies:
            for t in self.kv.values():
                if isinstance(t, list):
                    for s in t:
                        s[dst] = s[src]
                else:
                    t[:, dst] = t[:, src]

    # ------------------------------------------------------------------ checks

    def check_block_bytes(self, group: int, data: torch.Tensor, tokens: Sequence[int],
                          boundary: int, rid: str) -> list[str]:
        """Mismatches of one stored block value (``KVLayout`` byte order) against the KV of
        ``tokens[:boundary]``: the block's slots before the boundary, or the Mamba state."""
        gs = self.groups[group]
        vals = data.reshape(-1).contiguous().view(torch.float32)
        off = 0
        bad: list[str] = []
        for name in self.layer_names[group]:
            if gs.kind == "mamba":
                conv, ssm = self.expected_state(tokens, boundary, name, rid)
                got_c = vals[off : off + self.CONV]
                got_s = vals[off + self.CONV : off + self.CONV + self.SSM]
                off += self.CONV + self.SSM
                if not (torch.equal(got_c, conv) and torch.equal(got_s, ssm)):
                    bad.append(f"{name}: stored state is not the state at {boundary}")
                continue
            bs = gs.block_size
            kv = vals[off : off + 2 * bs * self.HEAD].view(2, bs, self.HEAD)
            off += 2 * bs * self.HEAD
            first = (cdiv(boundary, bs) - 1) * bs
            for p in range(first, boundary):
                if not torch.equal(kv[:, p - first], self.expected_slot(tokens, p, name, rid)):
                    bad.append(f"{name}: stored position {p} (boundary {boundary}) is wrong")
                    break
        return bad

    def expected_block_bytes(self, group: int, tokens: Sequence[int], boundary: int,
                             rid: str) -> torch.Tensor:
        """The value a correct put of ``tokens[:boundary]``'s block holds (slots past the
        boundary zero), in ``KVLayout`` byte order: for seeding a store directly."""
        gs = self.groups[group]
        parts: list[torch.Tensor] = []
        for name in self.layer_names[group]:
            if gs.kind == "mamba":
                conv, ssm = self.expected_state(tokens, boundary, name, rid)
                parts += [conv, ssm]
                continue
            bs = gs.block_size
            kv = torch.zeros(2, bs, self.HEAD)
            first = (cdiv(boundary, bs) - 1) * bs
            for p in range(first, boundary):
                kv[:, p - first] = self.expected_slot(tokens, p, name, rid)
            parts.append(kv.reshape(-1))
        return torch.cat(parts).view(torch.uint8)

    def check(self, rid: str, tokens: Sequence[int], start: int, hit: int,
              tables: Sequence[Sequence[int]]) -> list[str]:
        """Mismatches of the KV a request holds for ``[start, hit)`` (empty list: all intact).

        Full attention: every slot in ``[start, hit)``; sliding window: every slot in a block of
        its table (the blocks before the window are the null block: nothing is held there);
        Mamba: the state block at the hit.
        """
        bad: list[str] = []
        for g, gs in enumerate(self.groups):
            table = tables[g]
            for name in self.layer_names[g]:
                if gs.kind == "mamba":
                    idx = cdiv(hit, gs.block_size) - 1
                    blk = table[idx]
                    conv, ssm = self.expected_state(tokens, hit, name, rid)
                    t = self.kv[name]
                    assert isinstance(t, list)
                    same = torch.equal(t[0][blk].cpu(), conv) and torch.equal(t[1][blk].cpu(), ssm)
                    if not same:
                        bad.append(f"{name}: state block {blk} is not the state at {hit}")
                    continue
                t = self.kv[name]
                assert isinstance(t, torch.Tensor)
                for p in range(start, hit):
                    blk = table[p // gs.block_size]
                    if blk == 0 and gs.kind == "sliding_window":
                        continue
                    want = self.expected_slot(tokens, p, name, rid)
                    if not torch.equal(t[:, blk, p % gs.block_size, 0, :].cpu(), want):
                        bad.append(f"{name}: position {p} (block {blk}) has wrong KV")
                        break
        return bad
