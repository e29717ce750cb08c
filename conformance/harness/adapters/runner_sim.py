"""A CPU (or CUDA) stand-in for vLLM's model runner, for the ``impl`` adapter and tests.

It lives in the harness, not in ``tailproof.impl``: the ``impl`` adapter needs it whenever the
corpus replays on it (``tailproof replay --adapters impl``), and production never imports it.

Why: to check the connector's data path byte for byte without a GPU or a model. Every forward
write fills KV with bytes *derived from (rank, layer, group, token prefix)*: a full-attention slot
at position p holds ``content(prefix[:p+1])``, a Mamba state block after n tokens holds
``content(prefix[:n])``. A load is then correct iff every loaded slot / state equals what its
prefix must be -- reading a CoW source instead of its target, a stale or reused block, or an
off-by-one offset all show up as a byte mismatch.

The KV tensors are the ones vLLM 0.33 builds and registers, made by vLLM's own functions:
the group specs' pages padded to one size (as ``kv_cache_planning.unify_kv_cache_spec_page_size``
pads them), the ``KVCacheConfig`` from ``kv_cache_planning.get_kv_cache_config_from_groups``, the
one ``int8`` buffer and its per-layer 4D ``[B*r, H, N, C]`` views from
``v1/worker/utils.allocate_kv_cache`` (groups alias the same pages; attention views typed with K
and V fused in ``C``, optionally split into ``r`` kernel blocks; Mamba layers an ``int8`` page
view, unpacked into conv/SSM state views by vLLM's own ``MambaBase.bind_kv_cache``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from tailproof.impl.kv_layout import block_view
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


def group_specs(groups: Sequence[GroupShape], head: int, conv: int, ssm: int) -> list[Any]:
    """The ``KVCacheGroupSpec`` of each simulated group (layer names ``g{g}.l{i}``), pages padded
    to the largest as vLLM pads them (Mamba always; attention that keeps its block size)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    specs: list[Any] = []
    for gs in groups:
        if gs.kind == "mamba":
            specs.append(MambaSpec(block_size=gs.block_size, shapes=((conv,), (ssm,)),
                                   dtypes=(torch.float32, torch.float32),
                                   mamba_cache_mode="align"))
        else:
            specs.append(FullAttentionSpec(block_size=gs.block_size, num_kv_heads=1,
                                           head_size=head, dtype=torch.float32))
    page = max(sp.page_size_bytes for sp in specs)
    specs = [sp if sp.page_size_bytes == page else replace(sp, page_size_padded=page)
             for sp in specs]
    return [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(gs.layers)], sp)
            for g, (gs, sp) in enumerate(zip(groups, specs, strict=True))]


def allocate(specs: Sequence[Any], num_blocks: int, layout: str, kernel_split: int,
             device: str) -> tuple[Any, dict[str, torch.Tensor], list[int]]:
    """vLLM 0.33's own allocation for these groups: ``(KVCacheConfig, {layer: view},
    kernel block sizes)``. ``kernel_split`` r splits each unpadded attention block into r
    kernel blocks (``prepare_kernel_block_sizes``), when r divides the block size."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    lay = KVCacheLayout[layout]
    # The three config fields these functions read (cache layout, block-count override,
    # retention interval; no HiSparse).
    shim = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay,
                                     num_gpu_blocks_override=num_blocks,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(shim, list(specs), 0)
    kernel = []
    for g in specs:
        sp, bs = g.kv_cache_spec, g.kv_cache_spec.block_size
        split = (isinstance(sp, AttentionSpec) and sp.page_size_padded is None
                 and kernel_split > 1 and bs % kernel_split == 0)
        kernel.append(bs // kernel_split if split else bs)
    views = allocate_kv_cache(config, torch.device(device), lay, kernel)
    return config, views, kernel


class SimRunner:
    """One worker's KV tensors (vLLM 0.33's real registration layout) plus a deterministic
    "forward" that fills them."""

    HEAD = 4  # floats per full-attention slot (per K and V)
    CONV, SSM = 3, 5  # floats per Mamba conv / ssm state

    def __init__(self, groups: Sequence[GroupShape], num_blocks: int, rank: int = 0,
                 device: str = "cpu", *, layout: str = "LBNHC", kernel_split: int = 1):
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.rank = rank
        self.specs = group_specs(self.groups, self.HEAD, self.CONV, self.SSM)
        self.kv_cache_config, views, self.kernel_block_sizes = allocate(
            self.specs, num_blocks, layout, kernel_split, device)
        #: What vLLM registers with the connector: one 4D view per layer.
        self.kv: dict[str, torch.Tensor] = dict(views)
        self.layer_names: list[list[str]] = [list(g.layer_names) for g in self.specs]
        # Per attention layer: (kernel rows per block, tokens per kernel block); per Mamba
        # layer: its (conv, ssm) state views, unpacked by vLLM's own MambaBase.bind_kv_cache.
        self._rows: dict[str, tuple[int, int]] = {}
        self._states: dict[str, tuple[torch.Tensor, ...]] = {}
        for g, gs in enumerate(self.groups):
            for name in self.layer_names[g]:
                if gs.kind == "mamba":
                    # state_alignment: 0.34's bind_kv_cache rounds each state up to it
                    # (MambaBase's default, 1: packed contiguously, as 0.33 always packs).
                    layer = SimpleNamespace(
                        get_state_shape=lambda: ((self.CONV,), (self.SSM,)),
                        get_state_dtype=lambda: (torch.float32, torch.float32),
                        state_alignment=getattr(MambaBase, "state_alignment", 1))
                    MambaBase.bind_kv_cache(layer, self.kv[name])
                    self._states[name] = layer.kv_cache
                else:
                    kb = self.kernel_block_sizes[g]
                    self._rows[name] = (gs.block_size // kb, kb)
        self._digests: dict[str, PrefixDigests] = {}

    def _slot(self, name: str, block: int, offset: int) -> torch.Tensor:
        """The fused K/V row (2 * HEAD floats) of one token slot of an attention layer."""
        r, kb = self._rows[name]
        return self.kv[name][block * r + offset // kb, 0, offset % kb]

    # ------------------------------------------------------------------ expected content

    def _seed(self, rid: str, tokens: Sequence[int], n: int, layer: str) -> bytes:
        d = self._digests.setdefault(rid, PrefixDigests()).at(tokens, n)
        return _digest(self.rank, layer, d)

    def expected_slot(self, tokens: Sequence[int], p: int, layer: str, rid: str) -> torch.Tensor:
        """Fused K/V of position p given the prefix ``tokens[:p+1]``: ``2 * HEAD`` floats, K
        then V (the ``C`` axis of vLLM 0.33's attention page view)."""
        return content(2 * self.HEAD, self._seed(rid, tokens, p + 1, layer))

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
                    states = self._states[name]
                    states[0][blk] = conv
                    states[1][blk] = ssm
                    continue
                for p in range(start, end):
                    if p // gs.block_size >= len(table) or table[p // gs.block_size] == 0:
                        continue  # no block holds this position (bookkeeping-only traces)
                    blk = table[p // gs.block_size]
                    self._slot(name, blk, p % gs.block_size)[:] = self.expected_slot(
                        tokens, p, name, rid)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply the step's CoW copies (src -> dst) to every layer (a page is one block id)."""
        pages = [block_view(t, self.num_blocks) for t in self.kv.values()]
        for src, dst in copies:
            for b in pages:
                b[dst] = b[src]

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
            kv = vals[off : off + 2 * bs * self.HEAD].view(bs, 2 * self.HEAD)
            off += 2 * bs * self.HEAD
            first = (cdiv(boundary, bs) - 1) * bs
            for p in range(first, boundary):
                if not torch.equal(kv[p - first], self.expected_slot(tokens, p, name, rid)):
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
            kv = torch.zeros(bs, 2 * self.HEAD)
            first = (cdiv(boundary, bs) - 1) * bs
            for p in range(first, boundary):
                kv[p - first] = self.expected_slot(tokens, p, name, rid)
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
                    st = self._states[name]
                    same = (torch.equal(st[0][blk].cpu(), conv)
                            and torch.equal(st[1][blk].cpu(), ssm))
                    if not same:
                        bad.append(f"{name}: state block {blk} is not the state at {hit}")
                    continue
                for p in range(start, hit):
                    blk = table[p // gs.block_size]
                    if blk == 0 and gs.kind == "sliding_window":
                        continue
                    want = self.expected_slot(tokens, p, name, rid)
                    if not torch.equal(self._slot(name, blk, p % gs.block_size).cpu(), want):
                        bad.append(f"{name}: position {p} (block {blk}) has wrong KV")
                        break
        return bad
