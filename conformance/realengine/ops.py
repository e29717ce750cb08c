"""Pure-torch equivalents of the native ``_C`` ops vLLM 0.33's CPU path calls.

Why: the installed vLLM wheel is a CUDA build, so ``torch.ops._C`` has no CPU kernels. The
test-bed platform (``platform.TestBedPlatform.import_kernels``) registers these instead; each
mirrors the contract of the op it replaces, cited per function. Registered once per process.
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_LIB: torch.library.Library | None = None
PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils.PAD_SLOT_ID

OPS = ("init_cpu_memory_env", "compute_slot_mapping_kernel_impl", "greedy_argmax",
       "fused_gumbel_argmax")


def init_cpu_memory_env(nodes: list[int]) -> None:
    """``CPUWorker.__init__`` binds the worker's memory node; one-node test bed: nothing to do."""


def compute_slot_mapping_kernel_impl(query_start_loc: torch.Tensor, positions: torch.Tensor,
                                     block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                     block_size: int) -> None:
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size, per token;
    the rest padded with PAD_SLOT_ID (``ComputeSlotMappingKernel.kernel``, block_table.py)."""
    qsl = query_start_loc.to(torch.int64)
    n = int(qsl[-1])
    counts = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    pos = positions[:n].to(torch.int64)
    blocks = block_table[req, pos // block_size].to(torch.int64)
    slot_mapping[:n] = blocks * block_size + pos % block_size
    slot_mapping[n:] = PAD_SLOT_ID


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, first index on ties (``Sampler.greedy_sample``'s non-CPU branch)."""
    return logits.argmax(dim=-1).view(-1)


def fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """argmax(logits + Gumbel noise), the noise of row i drawn from seed ``seeds[i]``
    (``TopKTopPSampler`` random sampling on CPU)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i in range(logits.shape[0]):
        g = torch.Generator().manual_seed(int(seeds[i]))
        u = torch.rand(logits.shape[1], generator=g, dtype=torch.float64).clamp_(1e-20, 1.0)
        out[i] = int(torch.argmax(logits[i].double() - torch.log(-torch.log(u))))
    return out


def register() -> None:
    """Define the four ops in the ``_C`` namespace (idempotent; keeps the library alive)."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define("init_cpu_memory_env(int[] nodes) -> ()")
        lib.define("compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, "
                   "Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()")
        lib.define("greedy_argmax(Tensor logits) -> Tensor")
        lib.define("fused_gumbel_argmax(Tensor logits, Tensor seeds) -> Tensor")
        for name in OPS:
            lib.impl(name, globals()[name], "CompositeExplicitAutograd")
        _LIB = lib
