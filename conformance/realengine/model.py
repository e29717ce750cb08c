"""A tiny deterministic hybrid model for the test bed: vLLM ``Attention`` and ``MambaBase`` layers.

Registered with vLLM's ``ModelRegistry`` through ``vllm.general_plugins``
(``plugins.register_model``, only under ``TAILPROOF_TESTBED=1``). Weights come from a seed at
run time (:func:`write_model_dir` writes ``config.json`` + ``model.safetensors``; nothing is
downloaded) and vLLM's own ``DefaultModelLoader`` loads them.

Layers alternate attention and Mamba (:func:`layer_kinds`, Jamba's ``attn_layer_period`` /
``attn_layer_offset``), so each KV cache group holds several layers and the connector's per-layer
offsets matter. Attention comes first by default: vLLM 0.33's block copy
(``copy_kv_cache_blocks_inplace``, ``v1/worker/utils.py``) copies each shared page once, through the
first layer's view, and a Mamba view first covers only the state bytes of its padded page, so the
attention K/V sharing that page is not copied on a device partial hit (``mamba_first=True``
reproduces it; docs/impl.md; fixed in 0.34). The Mamba layers are Mamba-1 in plain torch: backend
``MAMBA1`` (vLLM's ``Mamba1AttentionMetadataBuilder``), conv and SSM state kept in the Mamba group's
pages (``MambaBase.bind_kv_cache`` views), read and written at
``state_indices_tensor_p/_d``, starting from zeros where ``has_initial_states_p`` is false.

Why outputs depend on every cached value: no normalisation or saturating activation sits
between a state and the logits (a residual stream of linear maps, one SiLU gate), the SSM decays
slowly (states carry hundreds of tokens), attention reads every key back from the paged cache,
and the vocabulary is small, so perturbing one block's K/V or one Mamba state moves the logits
enough to change greedy tokens (``tests/realengine`` checks it). Why outputs do not depend on
chunking: every product is computed in float64 and rounded to float32 once, and the recurrent
state is rounded to float32 after every token, so a token's state is the same whether it was
computed in one chunk, in many, or resumed from a loaded block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

ARCH = "TailproofTestBedHybridForCausalLM"
NUM_LAYERS = 4
OUT_GAIN = 0.25  # scale of each mixer's output projection
CONFIG: dict[str, Any] = {
    "architectures": [ARCH],
    "model_type": "jamba",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_layer_period": 2,
    "attn_layer_offset": 0,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_dt_rank": 4,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64, rounded to float32 once (chunking-invariant up to that rounding)."""
    return (x.double() @ w.double().T).float()


def _tp() -> tuple[int, int]:
    """This worker's tensor-parallel (rank, size)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """The sum of a row-parallel product's per-rank partials (the identity at TP=1)."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(partial)


def _shard(size: int, rank: int, tp: int, offset: int = 0) -> torch.Tensor:
    """Indices of rank's contiguous ``1/tp`` of ``size`` entries, starting at ``offset``."""
    n = size // tp
    return torch.arange(offset + rank * n, offset + (rank + 1) * n)


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """"attention" or "mamba" per layer (Jamba's rule: ``i % period == offset`` is attention)."""
    period, offset = cfg["attn_layer_period"], cfg["attn_layer_offset"]
    return ["attention" if i % period == offset else "mamba"
            for i in range(cfg["num_hidden_layers"])]


def make_config(mamba_first: bool = False) -> dict[str, Any]:
    """The model's ``config.json``; ``mamba_first`` puts a Mamba layer first (see above)."""
    return {**CONFIG, "attn_layer_offset": 1 if mamba_first else 0}


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape (the checkpoint's and the module's)."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    di, n = cfg["mamba_expand"] * d, cfg["mamba_d_state"]
    r, k = cfg["mamba_dt_rank"], cfg["mamba_d_conv"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // h
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens": (v, d), "lm_head": (v, d)}
    for i, kind in enumerate(layer_kinds(cfg)):
        p = f"model.layers.{i}"
        if kind == "mamba":
            shapes.update({
                f"{p}.mixer.in_proj": (2 * di, d), f"{p}.mixer.conv_w": (k, di),
                f"{p}.mixer.conv_b": (di,), f"{p}.mixer.x_proj": (r + 2 * n, di),
                f"{p}.mixer.dt_proj_w": (di, r), f"{p}.mixer.dt_proj_b": (di,),
                f"{p}.mixer.A_log": (di, n), f"{p}.mixer.D": (di,),
                f"{p}.mixer.out_proj": (d, di)})
        else:
            shapes.update({f"{p}.self_attn.qkv_proj": ((h + 2 * kv) * hd, d),
                           f"{p}.self_attn.o_proj": (d, h * hd)})
    return shapes


def make_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights from ``seed`` (same seed, same bytes, any machine)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":  # decay rates 0.01..1: some channels remember hundreds of tokens
            t = torch.log(torch.empty(shape).uniform_(0.01, 1.0, generator=g))
        elif leaf == "dt_proj_b":  # softplus^-1 of a step in 0.05..0.5
            dt = torch.empty(shape).uniform_(0.05, 0.5, generator=g)
            t = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "D":
            t = torch.ones(shape) + 0.1 * torch.randn(shape, generator=g)
        elif leaf in ("conv_b",):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens":
            t = torch.randn(shape, generator=g)
        elif leaf in ("out_proj", "o_proj"):  # mixer outputs O(1): the residual stays O(1)
            t = torch.randn(shape, generator=g) * (OUT_GAIN / math.sqrt(shape[-1]))
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1] if leaf != "conv_w" else 2)
        out[name] = t.float().contiguous()
    return out


def write_model_dir(path: str | Path, seed: int = 0, mamba_first: bool = False) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (weights from ``seed``) under ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = make_config(mamba_first)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(make_weights(cfg, seed), str(path / "model.safetensors"))
    return path


def _params(module: nn.Module, names: dict[str, tuple[int, ...]], prefix: str) -> None:
    """Register (zero) the parameters named ``<prefix>.<leaf>`` directly on ``module``."""
    head = f"{prefix}." if prefix else ""
    for name, shape in names.items():
        leaf = name[len(head):]
        if name.startswith(head) and "." not in leaf:
            module.register_parameter(leaf, nn.Parameter(torch.zeros(shape), requires_grad=False))


def _mamba_base() -> type:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return MambaBase


class TestBedMamba(_mamba_base(), nn.Module):
    """A Mamba-1 mixer in plain torch whose conv and SSM states live in vLLM's Mamba pages."""

    def __init__(self, cfg: dict[str, Any], model_config: Any, cache_config: Any,
                 prefix: str) -> None:
        nn.Module.__init__(self)
        from vllm.config import get_current_vllm_config

        self.prefix = prefix
        self.model_config = model_config
        self.cache_config = cache_config
        d = cfg["hidden_size"]
        self.di, self.n = cfg["mamba_expand"] * d, cfg["mamba_d_state"]
        self.r, self.k = cfg["mamba_dt_rank"], cfg["mamba_d_conv"]
        # Tensor parallel: this rank's channels (Mamba-1's column-parallel in/dt projections,
        # row-parallel x/out projections, as vLLM's MambaMixer shards them).
        rank, self.tp = _tp()
        self.dl = self.di // self.tp
        self.ch = _shard(self.di, rank, self.tp)
        self.xz_rows = torch.cat([self.ch, self.ch + self.di])
        _params(self, weight_shapes(cfg), prefix)
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    # -- MambaBase
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

        return MambaStateShapeCalculator.mamba1_state_shape(
            tp_world_size=self.tp, intermediate_size=self.di, state_size=self.n,
            conv_kernel=self.k)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

        return MambaStateDtypeCalculator.mamba1_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype)

    @property
    def mamba_type(self) -> Any:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        return MambaAttentionBackendEnum.MAMBA1

    # -- compute
    def _conv_states(self) -> torch.Tensor:
        """All blocks' conv states as ``[B, K-1, di/tp]`` (a view in either vLLM conv layout)."""
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv = self.kv_cache[0]
        return conv.transpose(-1, -2) if is_conv_state_dim_first() else conv

    def _run(self, x: torch.Tensor, z: torch.Tensor, idx: int, init: bool) -> torch.Tensor:
        """One request's tokens ``x, z: [T, di/tp]`` (this rank's channels) from the state in
        block ``idx`` (zeros when not ``init``); writes the final state back to block ``idx``;
        returns ``y: [T, di/tp]``."""
        conv_all, ssm_all = self._conv_states(), self.kv_cache[1]
        ch = self.ch
        if init:
            conv0, ssm = conv_all[idx].clone(), ssm_all[idx].clone()
        else:
            conv0 = torch.zeros(self.k - 1, self.dl)
            ssm = torch.zeros(self.dl, self.n)
        window = torch.cat([conv0, x], dim=0)  # [K-1+T, di]
        t = x.shape[0]
        taps = window.unfold(0, self.k, 1)  # [T, di, K]
        xc = ((taps.double() * self.conv_w[:, ch].double().T).sum(-1)
              + self.conv_b[ch].double())
        xc = torch.nn.functional.silu(xc).float()
        dbc = _all_reduce(_mm(xc, self.x_proj[:, ch]))
        dt = torch.nn.functional.softplus(
            (dbc[:, : self.r].double() @ self.dt_proj_w[ch].double().T)
            + self.dt_proj_b[ch].double())
        b = dbc[:, self.r: self.r + self.n].double()
        c = dbc[:, self.r + self.n:].double()
        a = -torch.exp(self.A_log[ch].double())
        decay = torch.exp(dt.unsqueeze(-1) * a)  # [T, di/tp, n]
        drive = dt.unsqueeze(-1) * b.unsqueeze(1) * xc.double().unsqueeze(-1)
        states = torch.empty(t, self.dl, self.n)
        for i in range(t):  # float32 state after every token: chunking-invariant
            ssm = (decay[i] * ssm.double() + drive[i]).float()
            states[i] = ssm
        y = (states.double() * c.unsqueeze(1)).sum(-1) + self.D[ch].double() * xc.double()
        y = (y * torch.nn.functional.silu(z.double())).float()
        conv_all[idx] = window[t:]
        ssm_all[idx] = ssm
        return y

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        out = torch.zeros_like(hidden)
        meta_all = get_forward_context().attn_metadata
        meta = meta_all.get(self.prefix) if isinstance(meta_all, dict) else None
        if meta is None:  # profiling run: no states
            return out
        xz = _mm(hidden, self.in_proj[self.xz_rows])
        x, z = xz[:, : self.dl], xz[:, self.dl:]
        nd = meta.num_decode_tokens
        spans: list[tuple[int, int, int, bool]] = []
        if meta.num_decodes:
            sid = meta.state_indices_tensor_d[:, 0].tolist()
            spans += [(i, i + 1, sid[i], True) for i in range(meta.num_decodes)]
        if meta.num_prefills:
            qsl = meta.query_start_loc_p.tolist()
            sid = meta.state_indices_tensor_p.tolist()
            init = meta.has_initial_states_p.tolist()
            spans += [(nd + qsl[j], nd + qsl[j + 1], sid[j], bool(init[j]))
                      for j in range(meta.num_prefills)]
        w_out = self.out_proj[:, self.ch]
        for s, e, idx, init in spans:
            if e > s:
                out[s:e] = _mm(self._run(x[s:e], z[s:e], idx, init), w_out)
        return _all_reduce(out)


class TestBedAttention(nn.Module):
    """QKV projections around vLLM's own ``Attention`` layer (GQA, no positional encoding: the
    Mamba layers before it carry position). Under tensor parallelism each rank has ``1/tp`` of
    the query and KV heads (column-parallel QKV, row-parallel output, as vLLM's
    ``QKVParallelLinear`` / ``RowParallelLinear``)."""

    def __init__(self, cfg: dict[str, Any], cache_config: Any, prefix: str) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg["hidden_size"] // h
        rank, tp = _tp()
        self.h, self.kv = h // tp, kv // tp
        q_cols = _shard(h * self.hd, rank, tp)
        self.qkv_rows = torch.cat([q_cols, _shard(kv * self.hd, rank, tp, h * self.hd),
                                   _shard(kv * self.hd, rank, tp, (h + kv) * self.hd)])
        self.o_cols = q_cols
        _params(self, weight_shapes(cfg), prefix)
        self.attn = Attention(self.h, self.hd, 1.0 / math.sqrt(self.hd), num_kv_heads=self.kv,
                              cache_config=cache_config, prefix=f"{prefix}.attn")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = _mm(hidden, self.qkv_proj[self.qkv_rows])
        q, k, v = qkv.split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous())
        return _all_reduce(_mm(out, self.o_proj[:, self.o_cols]))


def _hybrid_bases() -> tuple[type, ...]:
    from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

    return (nn.Module, HasInnerState, IsHybrid)


class TailproofTestBedHybridForCausalLM(*_hybrid_bases()):
    """Embedding, residual mixers (:func:`layer_kinds`), LM head; ``IsHybrid`` for vLLM."""

    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config.to_dict()
        cache = vllm_config.cache_config
        shapes = weight_shapes(cfg)
        self.kinds = layer_kinds(cfg)
        _params(self, {"lm_head": shapes["lm_head"]}, "")
        self.model = nn.Module()
        _params(self.model, shapes, "model")
        layers = []
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}"
            block = nn.Module()
            if kind == "mamba":
                block.mixer = TestBedMamba(cfg, vllm_config.model_config, cache, f"{p}.mixer")
            else:
                block.self_attn = TestBedAttention(cfg, cache, f"{p}.self_attn")
            layers.append(block)
        self.model.layers = nn.ModuleList(layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens[input_ids]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for block, kind in zip(self.model.layers, self.kinds, strict=True):
            mixer = block.mixer if kind == "mamba" else block.self_attn
            h = h + mixer(h)
        return h

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _mm(hidden_states, self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

        cc = vllm_config.cache_config
        return MambaStateDtypeCalculator.mamba1_state_dtype(
            vllm_config.model_config.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

        hf = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.mamba1_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
            intermediate_size=hf.mamba_expand * hf.hidden_size, state_size=hf.mamba_d_state,
            conv_kernel=hf.mamba_d_conv)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()

