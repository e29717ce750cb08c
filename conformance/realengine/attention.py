"""A plain-torch paged attention backend for the test bed (vLLM's ``CPU_ATTN`` needs native ops).

Mirrors vLLM's ``FlashAttentionBackend`` (0.33 and 0.34) where the connector can see it: the KV
cache of a layer is the 4D view ``[B, H, N, 2*D]`` that ``allocate_kv_cache``
(``v1/worker/utils.py``) builds over the shared int8 buffer, K and V fused in the last axis, no
layout preference (``supported_kv_cache_layouts`` None, so vLLM resolves its default ``LBNHC``), the
cache written by ``do_kv_cache_update`` through ``slot_mapping`` before ``forward`` reads it
(``forward_includes_kv_cache_update = False``). Attention reads every key back from the paged
cache (gathered through the block table), so a loaded block that differs by one value changes
the output. Arithmetic is float64 and rounded to float32 once, so a token's result does not
depend on how the batch was chunked (the oracle compares runs with different chunk boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)


class TorchPagedAttentionBackend(AttentionBackend):
    """Decoder self-attention over vLLM's paged KV cache, in plain torch."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # as FlashAttention

    @staticmethod
    def get_name() -> str:
        # vLLM's slot for an out-of-tree backend (``AttentionBackendEnum.CUSTOM``; the
        # platform registers this class there, ``register_backend``).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TorchPagedAttentionImpl]:
        return TorchPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TorchPagedMetadataBuilder]:
        return TorchPagedMetadataBuilder


@dataclass
class TorchPagedMetadata:
    """Per-step metadata: host copies of the request boundaries, the block table, the slots."""

    num_actual_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]


class TorchPagedMetadataBuilder(AttentionMetadataBuilder[TorchPagedMetadata]):
    """Builds :class:`TorchPagedMetadata` from vLLM's ``CommonAttentionMetadata``."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchPagedMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return TorchPagedMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=[int(x) for x in m.query_start_loc_cpu[: n + 1]],
            seq_lens=[int(x) for x in m.seq_lens[:n].cpu()],
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


def split_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, 2D]`` -> K, V as ``[B, N, H, D]`` views (FlashAttentionImpl.forward's split)."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


class TorchPagedAttentionImpl(AttentionImpl[TorchPagedMetadata]):
    """Causal GQA over the gathered blocks of each request, float64 inside."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra: Any) -> None:
        if attn_type != AttentionType.DECODER or sliding_window is not None:
            raise NotImplementedError("test-bed attention: decoder, full attention only")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter this step's K/V into their slots (``reshape_and_cache_flash``)."""
        n = slot_mapping.numel()
        if n == 0 or kv_cache.numel() == 0:
            return
        k_cache, v_cache = split_kv(kv_cache, self.head_size)
        slots = slot_mapping.to(torch.int64)
        keep = slots >= 0
        slots = slots[keep]
        block_size = kv_cache.shape[2]
        blk, off = slots // block_size, slots % block_size
        k_cache[blk, off] = key[:n][keep].to(k_cache.dtype)
        v_cache[blk, off] = value[:n][keep].to(v_cache.dtype)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TorchPagedMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        m = attn_metadata
        qsl, lens = m.query_start_loc, m.seq_lens
        single = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        if single:  # decodes (and one-token chunks): one batched call
            rows = [qsl[i] for i in single]
            out = self._attend(kv_cache, m.block_table[single], [lens[i] for i in single],
                               query[rows].unsqueeze(1))
            output[rows] = out[:, 0].to(output.dtype)
        for i, seq_len in enumerate(lens):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 - q0 > 1:
                out = self._attend(kv_cache, m.block_table[i: i + 1], [seq_len],
                                   query[q0:q1].unsqueeze(0))
                output[q0:q1] = out[0].to(output.dtype)
        return output

    def _attend(self, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                q: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q: [R, Q, H, D]`` (the last Q positions of each of R requests)
        over the keys gathered from each request's blocks; returns ``[R, Q, H, D]``."""
        k_cache, v_cache = split_kv(kv_cache, self.head_size)
        block_size = kv_cache.shape[2]
        smax = max(seq_lens)
        ids = block_table[:, : -(-smax // block_size)].to(torch.int64)
        r, nq = q.shape[0], q.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        k = k_cache[ids].reshape(r, -1, kvh, d)[:, :smax].double()  # [R, S, KVH, D]
        v = v_cache[ids].reshape(r, -1, kvh, d)[:, :smax].double()
        qg = q.double().reshape(r, nq, kvh, g, d)
        scores = torch.einsum("rqkgd,rskd->rkgqs", qg, k) * self.scale
        lens = torch.tensor(seq_lens).view(r, 1, 1)
        qpos = lens - nq + torch.arange(nq).view(1, nq, 1)  # [R, Q, 1]
        spos = torch.arange(smax).view(1, 1, smax)
        mask = (spos > qpos).view(r, 1, 1, nq, smax)  # future keys (and padding past seq_len)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = torch.einsum("rkgqs,rskd->rqkgd", probs, v)
        return out.reshape(r, nq, kvh * g, d)
