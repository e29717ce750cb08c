"""Where a KV cache block's bytes live, and how to copy whole blocks out of / into them.

Semantics: none in the reference (it models keys, not bytes; the ``impl`` adapter checks the
bytes). Mirrors vLLM 0.33's ``ChunkedTokenDatabase`` / ``RankLocalStoreLayout``
(``register_kv_caches``, ``prepare_value_for_block``).

What vLLM 0.33 registers (``gpu_model_runner.initialize_kv_cache`` -> ``allocate_kv_cache`` in
``v1/worker/utils.py`` -> ``kv_cache_interface.create_kv_cache_views``): one raw ``int8``
buffer, viewed per layer as a 4D logical ``[B * r, H, N, C]`` page view with the layout's
strides (``KVCacheLayout``: LBHNC, LBNHC, BLHNC, ...). Attention views are typed (``C`` = K and
V fused, ``(head_size + head_size_v)`` elements); Mamba views stay ``int8`` (``C`` = the layer's
packed conv/SSM state bytes, ``H = N = 1``). Pages are padded to one size across groups
(``page_size_padded``); the padding lies outside the view. An attention block may be split
into ``r`` kernel blocks (``prepare_kernel_block_sizes``): rows ``b*r .. b*r+r-1``.

The canonical value: a store value is "every byte of one block of one group on this rank":
the concatenation over the group's layers of that block's page in *logical* ``[H, N, C]``
order, the ``r`` kernel blocks merged along ``N``. So the value depends on neither the
kernel-block split nor the physical stride order nor the page padding -- two engines that
differ only there store interchangeable bytes (docs/store-format.md). Other ranks (a legacy
list of per-state tensors) are a block-major ``(num_blocks, ...)`` tensor each, row-major.

Copies: one block at a time between the KV tensors and a store value (:meth:`read_block` /
:meth:`write_block`: one strided ``numpy.copyto`` per tensor on CPU, which releases the GIL; an
asynchronous copy on the caller's CUDA stream on a GPU) -- the connector's data path; many
blocks at once with index ops (:meth:`gather` / :meth:`scatter`), for tests and tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import torch


@dataclass(frozen=True)
class Segment:
    """One registered tensor of one layer, as a block-major canonical byte view."""

    layer: str
    tensor: torch.Tensor  # as vLLM registered it
    blocks: torch.Tensor  # uint8 view, ``[b]`` = block b's bytes in canonical order (no copy)

    @property
    def block_nbytes(self) -> int:
        return prod(self.blocks.shape[1:])

    @property
    def page_shape(self) -> tuple[int, ...] | None:
        """``(H, N, C bytes)`` of one block of a 4D page view (None: not a page view)."""
        if self.tensor.dim() != 4:
            return None
        h, r, n, c = self.blocks.shape[1:]
        return (h, r * n, c)


def block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The uint8 view of ``t`` indexed by manager block first, each block in canonical order.

    4D page view ``[B*r, H, N, C]``: ``(num_blocks, H, r, N, C bytes)`` (kernel blocks merged
    along ``N``, ``kv_cache_interface.group_kernel_blocks``); any other tensor: ``(num_blocks,
    ...)`` with ``r = 1``. Raises ``ValueError`` naming the shape when ``t`` has no block axis.
    """
    rows = t.shape[0] if t.dim() else 0
    if rows < num_blocks or rows % num_blocks:
        raise ValueError(f"KV cache tensor of shape {tuple(t.shape)} has no block dimension "
                         f"for {num_blocks} blocks (dim 0 must be a multiple of it)")
    r = rows // num_blocks
    if t.dim() != 4 and r != 1:
        raise ValueError(f"KV cache tensor of shape {tuple(t.shape)}: {r} rows per block, but "
                         "kernel-block splits exist only for 4D [B, H, N, C] page views")
    if t.dtype != torch.uint8:
        if t.stride(-1) != 1:
            raise ValueError(f"KV cache tensor of shape {tuple(t.shape)} and strides "
                             f"{t.stride()}: its last axis (C) is not contiguous")
        t = t.view(torch.uint8)
    if t.dim() != 4:
        return t
    return t.unflatten(0, (num_blocks, r)).permute(0, 2, 1, 3, 4)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class KVLayout:
    """Per store group: the segments of its layers, and the bytes of one block."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        layer_groups: Sequence[Sequence[str]], num_blocks: int,
    ):
        self.num_blocks = num_blocks
        self.groups: list[list[Segment]] = []
        # Per layer: bytes of one block, and its (H, N, C) page shape (checked against specs).
        self.layer_bytes: dict[str, int] = {}
        self.layer_page_shapes: dict[str, tuple[int, ...] | None] = {}
        self.layer_itemsizes: dict[str, list[int]] = {}
        # Layers whose registered view is another layer's (cross-layer KV sharing,
        # ``initialize_kv_cache_tensors``): their bytes are stored once, under the target.
        self.aliases: dict[str, str] = {}
        for names in layer_groups:
            segs: list[Segment] = []
            for name in names:
                if name not in kv_caches:
                    continue  # a layer this rank does not hold (pipeline parallelism)
                val = kv_caches[name]
                tensors = [val] if isinstance(val, torch.Tensor) else list(val)
                target = next((s.layer for s in segs if len(tensors) == 1
                               and _same_view(s.tensor, tensors[0])), None)
                if target is not None:
                    self.aliases[name] = target
                    continue
                for t in tensors:
                    seg = Segment(name, t, block_view(t, num_blocks))
                    segs.append(seg)
                    self.layer_bytes[name] = self.layer_bytes.get(name, 0) + seg.block_nbytes
                    self.layer_itemsizes.setdefault(name, []).append(t.element_size())
                self.layer_page_shapes[name] = (segs[-1].page_shape if len(tensors) == 1
                                                else None)
            self.groups.append(segs)
        self.block_nbytes = [sum(s.block_nbytes for s in segs) for segs in self.groups]
        devs = {s.tensor.device for segs in self.groups for s in segs}
        self.device = next(iter(devs)) if devs else torch.device("cpu")
        self._blocks: list[list[torch.Tensor]] = [[s.blocks for s in segs]
                                                  for segs in self.groups]
        # CPU: numpy views (strided, no copy), so a block copy is one copyto per tensor.
        self._np_blocks: list[list[np.ndarray]] | None = None
        if self.device.type == "cpu":
            self._np_blocks = [[b.numpy() for b in bs] for bs in self._blocks]

    def read_block(self, group: int, block_id: int, out: np.ndarray | torch.Tensor) -> None:
        """Copy one block's bytes into ``out`` (``block_nbytes[group]`` uint8, the value).

        CPU: ``out`` is a numpy array (or CPU tensor), one ``copyto`` per tensor. GPU: ``out`` is
        a host tensor; the copies are queued on the current CUDA stream (``non_blocking``) and
        complete when that stream does.
        """
        if self._np_blocks is not None:
            dst = out if isinstance(out, np.ndarray) else out.numpy()
            off = 0
            for arr in self._np_blocks[group]:
                src = arr[block_id]
                np.copyto(dst[off : off + src.nbytes].reshape(src.shape), src)
                off += src.nbytes
            return
        dst_t = torch.as_tensor(out)
        off = 0
        for t in self._blocks[group]:
            src_t = t[block_id]
            n = src_t.numel()
            dst_t[off : off + n].view(src_t.shape).copy_(src_t, non_blocking=True)
            off += n

    def write_block(self, group: int, block_id: int, value: np.ndarray | torch.Tensor) -> None:
        """Copy a value's bytes into one block (the inverse of :meth:`read_block`)."""
        if self._np_blocks is not None:
            src = value if isinstance(value, np.ndarray) else value.numpy()
            off = 0
            for arr in self._np_blocks[group]:
                dst = arr[block_id]
                np.copyto(dst, src[off : off + dst.nbytes].reshape(dst.shape))
                off += dst.nbytes
            return
        src_t = torch.as_tensor(value)
        off = 0
        for t in self._blocks[group]:
            dst_t = t[block_id]
            n = dst_t.numel()
            dst_t.copy_(src_t[off : off + n].view(dst_t.shape), non_blocking=True)
            off += n

    def copy_block(self, group: int, src: int, dst: int) -> int:
        """Copy block ``src`` of every tensor of ``group`` onto block ``dst`` (device to device,
        on the current CUDA stream on a GPU); returns the bytes copied."""
        if self._np_blocks is not None:
            for arr in self._np_blocks[group]:
                np.copyto(arr[dst], arr[src])
        else:
            for t in self._blocks[group]:
                t[dst].copy_(t[src], non_blocking=True)
        return self.block_nbytes[group]

    def gather(self, group: int, block_ids: Sequence[int]) -> torch.Tensor:
        """``(n, block_nbytes)`` uint8 tensor (on the KV device) of the given blocks."""
        n = len(block_ids)
        parts = []
        for b in self._blocks[group]:
            ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=b.device)
            parts.append(b.index_select(0, ids).reshape(n, -1))
        if not parts:
            return torch.empty((n, 0), dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def scatter(self, group: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (``n * block_nbytes`` uint8, any device) into the given blocks."""
        n = len(block_ids)
        data = data.reshape(n, -1)
        off = 0
        for b in self._blocks[group]:
            width = prod(b.shape[1:])
            part = data[:, off : off + width].to(b.device).reshape(n, *b.shape[1:])
            off += width
            b.index_copy_(0, torch.as_tensor(list(block_ids), dtype=torch.long,
                                             device=b.device), part)
