"""A weightless hybrid stand-in model, so vLLM 0.33's real config + Scheduler build on CPU.

Product code of ``tailproof capture`` (and used by the tests): capturing a trace runs vLLM's
own ``Scheduler`` on named workloads without a GPU or weights, and vLLM validates ``--model`` by
inspecting its model class -- the real hybrid classes import GPU kernels (and ``einops``) in a
subprocess. The scheduler never runs the model, so this tiny class is registered under the
architecture named in ``tiny-hybrid/config.json`` (a Jamba-shaped config: one attention layer,
one Mamba layer) next to this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from torch import nn

ARCH = "TailproofTinyHybridForCausalLM"
MODEL_DIR = Path(__file__).parent / "tiny-hybrid"


class TailproofTinyHybridForCausalLM(nn.Module):
    """Declares the hybrid interface (attention + Mamba); has no layers and is never run."""

    is_hybrid: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: Any) -> Any:
        raise NotImplementedError("weightless stand-in model: never run")

    def forward(self, input_ids: Any, positions: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("weightless stand-in model: never run")

    def compute_logits(self, hidden_states: Any) -> Any:
        raise NotImplementedError("weightless stand-in model: never run")

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        return ((3, 16), (16, 16))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[Any, ...]:
        import torch

        return (torch.float32, torch.float32)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()


def register() -> None:
    """Register the class with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, TailproofTinyHybridForCausalLM)
