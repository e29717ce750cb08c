"""Where a KV cache block's bytes live, and how to copy whole blocks out of / into them.

Semantics: none in the reference (it models keys, not bytes; the ``impl`` adapter checks the
bytes). Mirrors vLLM 0.33's ``ChunkedTokenDatabase`` / ``RankLocalStoreLayout``
(``register_kv_caches``, ``prepare_value_for_block``).

Why: a store value is "every byte of one block of one group on this rank": the concatenation,
over the group's layers and each layer's tensors (K/V, or a Mamba layer's conv and SSM states),
of that block's slice. vLLM hands the connector ``{layer_name: tensor or [tensors]}`` in layouts
that differ per attention backend -- the block dimension is 0 (``(num_blocks, 2, ...)``, Mamba)
or 1 (``(2, num_blocks, ...)``, FlashAttention) and an attention block may be split into several
kernel blocks (``num_blocks * r`` rows). :class:`KVLayout` finds that dimension once, at
registration, and then copies blocks in two ways:

* one block at a time, straight between the KV tensors and a store value (:meth:`read_block`
  / :meth:`write_block`: one pass over the bytes, a single-threaded ``numpy.copyto`` per tensor
  on CPU, which releases the GIL; an asynchronous copy on the caller's CUDA stream on a GPU) --
  the connector's data path;
* many blocks at once with ``index_select``/``index_copy_`` (:meth:`gather` / :meth:`scatter`),
  kept for tests and tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Segment:
    """One tensor of one layer: its block dimension and rows per logical block."""

    tensor: torch.Tensor
    dim: int
    ratio: int  # kernel blocks per logical block

    @property
    def block_nbytes(self) -> int:
        t = self.tensor
        return t.numel() // t.shape[self.dim] * self.ratio * t.element_size()

    def by_block(self, num_blocks: int) -> torch.Tensor:
        """A uint8 view indexed by logical block first: ``[b]`` is block b's bytes in value
        order (``(ratio, ...)`` with the block dimension moved first), no copy."""
        t = self.tensor.view(torch.uint8) if self.tensor.dtype != torch.uint8 else self.tensor
        if self.dim:
            t = t.movedim(self.dim, 0)
        return t.view((num_blocks, self.ratio, *t.shape[1:]))


def find_block_dim(t: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """(dim, ratio) such that ``t.shape[dim] == num_blocks * ratio``.

    ``(2, num_blocks * r, ...)`` (K/V first, FlashAttention) -> dim 1; otherwise dim 0
    (``(num_blocks * r, ...)``: most attention backends and every Mamba state tensor).
    """
    ok = [
        d for d in (0, 1)
        if d < t.dim() and t.shape[d] >= num_blocks and t.shape[d] % num_blocks == 0
    ]
    if 1 in ok and t.shape[0] == 2 and num_blocks > 2:
        return 1, t.shape[1] // num_blocks
    if ok:
        return ok[0], t.shape[ok[0]] // num_blocks
    raise ValueError(
        f"KV cache tensor of shape {tuple(t.shape)} has no block dimension for "
        f"{num_blocks} blocks"
    )


class KVLayout:
    """Per store group: the segments of its layers, and the bytes of one block."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        layer_groups: Sequence[Sequence[str]], num_blocks: int,
    ):
        self.num_blocks = num_blocks
        self.groups: list[list[Segment]] = []
        # Per layer: bytes of one block and element sizes (checked against vLLM's specs).
        self.layer_bytes: dict[str, int] = {}
        self.layer_itemsizes: dict[str, list[int]] = {}
        for names in layer_groups:
            segs: list[Segment] = []
            for name in names:
                if name not in kv_caches:
                    continue  # a layer this rank does not hold (pipeline parallelism)
                val = kv_caches[name]
                tensors = [val] if isinstance(val, torch.Tensor) else list(val)
                for t in tensors:
                    dim, ratio = find_block_dim(t, num_blocks)
                    seg = Segment(t, dim, ratio)
                    segs.append(seg)
                    self.layer_bytes[name] = self.layer_bytes.get(name, 0) + seg.block_nbytes
                    self.layer_itemsizes.setdefault(name, []).append(t.element_size())
            self.groups.append(segs)
        self.block_nbytes = [sum(s.block_nbytes for s in segs) for segs in self.groups]
        devs = {s.tensor.device for segs in self.groups for s in segs}
        self.device = next(iter(devs)) if devs else torch.device("cpu")
        # Per group, per tensor: the block-major view (numpy on CPU: no torch op per copy).
        self._blocks: list[list[torch.Tensor]] = [
            [s.by_block(num_blocks) for s in segs] for segs in self.groups]
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

    @staticmethod
    def _rows(seg: Segment, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if seg.ratio > 1:
            ids = (ids[:, None] * seg.ratio + torch.arange(seg.ratio)[None, :]).reshape(-1)
        return ids.to(device)

    def gather(self, group: int, block_ids: Sequence[int]) -> torch.Tensor:
        """``(n, block_nbytes)`` uint8 tensor (on the KV device) of the given blocks."""
        n = len(block_ids)
        parts = []
        for seg in self.groups[group]:
            rows = self._rows(seg, block_ids, seg.tensor.device)
            sel = seg.tensor.index_select(seg.dim, rows).movedim(seg.dim, 0).contiguous()
            parts.append(sel.view(torch.uint8).reshape(n, -1))
        if not parts:
            return torch.empty((n, 0), dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def scatter(self, group: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (``n * block_nbytes`` uint8, any device) into the given blocks."""
        n = len(block_ids)
        data = data.reshape(n, -1)
        off = 0
        for seg in self.groups[group]:
            t = seg.tensor
            width = seg.block_nbytes
            part = torch.empty((n, width), dtype=torch.uint8, device=t.device)
            part.copy_(data[:, off : off + width])  # fresh, aligned storage for the dtype view
            off += width
            shape = list(t.shape)
            shape[seg.dim] = n * seg.ratio
            moved = [shape[seg.dim]] + shape[: seg.dim] + shape[seg.dim + 1 :]
            src = part.view(t.dtype).reshape(moved).movedim(0, seg.dim)
            t.index_copy_(seg.dim, self._rows(seg, block_ids, t.device), src)
