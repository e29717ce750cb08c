"""The layout fingerprint: a short digest of everything that decides what a stored block's bytes
mean, so two engines share store keys exactly when their bytes are interchangeable.

Why: a key that names only the prefix hash lets an fp16 engine's blocks load into a bf16 engine,
another checkpoint's blocks load under the same model path, or a pipeline stage's blocks load into
another stage -- the load "succeeds" with foreign values in the KV cache. The fingerprint covers:

* model identity: ``model``, ``model_weights``, ``revision``, ``code_revision`` (and the
  config revision vLLM resolved), the hub commit of the config when known, ``hf_config_path``,
  ``quantization`` (and ``quantization_config``), the runner/convert type, model class
  overrides, ``hf_overrides`` (any override of the model's config may change its numerics);
* RoPE as resolved into the model's text config, whatever its source (config file,
  ``hf_overrides``, ``hf_config_path``): K is cached *after* RoPE, so ``rope_theta`` or
  ``rope_scaling`` changes every cached K byte (:func:`rope_parts`);
* the weights' source (``LoadConfig.load_format``, :func:`weights_source`): ``dummy`` (random
  weights, benchmarks) never shares keys with real weights;
* dtypes: the model dtype, ``cache_dtype`` (KV-cache dtype), the Mamba state dtypes;
* per stored KV cache group: the full ``KVCacheSpec`` (type, block size, heads, head size, dtype,
  Mamba shapes and dtypes, ...) and, without pipeline parallelism, its layer names;
* parallelism: tensor, pipeline and decode-context parallel sizes and the pipeline layer
  partition (``VLLM_PP_LAYER_PARTITION``); the rank of a shard is in the key itself;
* the prefix hash: ``prefix_caching_hash_algo`` and the hash seed (``PYTHONHASHSEED``);
* the block geometry: group block sizes, Mamba flags, h, the lcm, hit alignment, EAGLE;
* the value's payload format (:data:`PAYLOAD_FORMAT`): each layer's logical ``[H, N, C]``
  page. The kernel-block split, the physical stride order (``KVCacheLayout``) and the page
  padding are deliberately *not* covered: the payload does not depend on them
  (``impl/kv_layout.py``), so engines that differ only there share values safely.

Both connector roles derive it from vLLM's config the same way (the scheduler has no tensors);
the worker then checks its registered tensors against the same specs (:func:`check_tensors`),
so a fingerprint can never claim a layout the worker does not actually hold.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Hex digits of the digest in every key (64 bits: accidental collisions are negligible).
DIGEST_HEX = 16


@dataclass(frozen=True)
class Fingerprint:
    """The digest (in every key and value header) and what it was computed from (logs)."""

    digest: str
    parts: Mapping[str, Any]

    @property
    def raw(self) -> bytes:
        """The digest as bytes (value header)."""
        return bytes.fromhex(self.digest)


def _canon(v: Any) -> Any:
    """A JSON-stable form of a config value (dtypes and enums by name, tuples as lists)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple, frozenset, set)):
        items = [_canon(x) for x in v]
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"type": type(v).__name__,
                **{f.name: _canon(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if callable(v) and hasattr(v, "__qualname__"):  # a function (``hf_overrides`` may be one)
        return f"callable:{getattr(v, '__module__', '?')}.{v.__qualname__}"
    text = str(v)  # torch.dtype and the like: "torch.float16"
    # An object without a stable text form must not make the digest differ per process.
    return type(v).__name__ if " at 0x" in text else text


def resolve_spec(spec: Any) -> Any:
    """The spec the scheduler sees for a group: a ``UniformTypeKVCacheSpecs`` becomes its first
    layer's spec, exactly as ``kv_cache_utils.generate_scheduler_kv_cache_config`` does."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, Mapping) and inner:
        return next(iter(inner.values()))
    return spec


def digest_of(parts: Mapping[str, Any]) -> Fingerprint:
    canon = _canon(parts)
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return Fingerprint(hashlib.blake2b(blob, digest_size=DIGEST_HEX // 2).hexdigest(), canon)


def model_identity(model_config: Any) -> dict[str, Any]:
    """Name plus every revision vLLM knows (a rolling upgrade at the same path must set one),
    and every ``ModelConfig`` field that changes what the model computes (vLLM 0.33's
    ``vllm.config.model.ModelConfig``; the fields left out are listed in docs/store-format.md)."""
    m = model_config
    hf = getattr(m, "hf_config", None)
    return {
        "model": getattr(m, "model", None),
        "model_weights": getattr(m, "model_weights", None) or None,
        "revision": getattr(m, "revision", None),
        "code_revision": getattr(m, "code_revision", None),
        "config_revision": getattr(m, "_hf_config_revision", None),
        "commit": getattr(hf, "_commit_hash", None) if hf is not None else None,
        "hf_config_path": getattr(m, "hf_config_path", None),
        "quantization": getattr(m, "quantization", None),
        "quantization_config": getattr(m, "quantization_config", None),
        "dtype": getattr(m, "dtype", None),
        "runner": getattr(m, "runner_type", None),
        "convert": getattr(m, "convert_type", None),
        "model_class_overrides": getattr(m, "model_class_overrides", None) or None,
        "hf_overrides": getattr(m, "hf_overrides", None) or None,
        "rope": rope_parts(getattr(m, "hf_text_config", None), getattr(m, "max_model_len", None)),
    }


#: Text-config attributes that decide RoPE (``transformers_utils.config.patch_rope_parameters``
#: folds the legacy names into ``rope_parameters``; both forms are read).
_ROPE_ATTRS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base",
               "partial_rotary_factor", "rotary_pct", "rotary_emb_fraction", "rotary_dim",
               "rope_local_base_freq", "max_position_embeddings",
               "original_max_position_embeddings", "position_embedding_type")
#: Keys vLLM's model code writes into a config's ``rope_parameters`` in place while it builds
#: the model (``gpt_j.GPTJAttention``: ``partial_rotary_factor`` from ``rotary_dim``): a worker
#: holds the model, the scheduler does not, so these keys would split the two roles' digests.
#: Each is derived from an attribute read above.
_ROPE_DERIVED = frozenset({"partial_rotary_factor"})


def rope_parts(hf_text_config: Any, max_model_len: int | None = None) -> dict[str, Any] | None:
    """The resolved RoPE parameters of a text config (None: no config, e.g. unit tests).

    ``max_model_len`` counts only where it picks the rotation: LongRoPE uses its long factors
    for every position once ``max_model_len`` exceeds ``original_max_position_embeddings``
    (vLLM 0.33 ``Phi3LongRoPEScaledRotaryEmbedding.__init__``)."""
    if hf_text_config is None:
        return None
    out: dict[str, Any] = {}
    longrope = [p for p in _rope_dicts(getattr(hf_text_config, "rope_parameters", None))
                if p.get("rope_type") == "longrope"]
    if longrope and max_model_len is not None:
        out["longrope_long_factors"] = [
            max_model_len > p.get("original_max_position_embeddings", max_model_len)
            for p in longrope]
    for name in _ROPE_ATTRS:
        try:
            val = getattr(hf_text_config, name, None)
        except Exception:  # noqa: BLE001 - a config property that cannot answer: not set
            val = None
        if isinstance(val, Mapping) and name in ("rope_parameters", "rope_scaling"):
            val = _without_derived(val)
        if val is not None:
            out[name] = val
    return out


def _rope_dicts(params: Any) -> list[Mapping[str, Any]]:
    """The rope parameter dicts of a config: one, or one per layer type when nested."""
    if not isinstance(params, Mapping):
        return []
    if params and all(isinstance(v, Mapping) for v in params.values()):
        return list(params.values())  # nested per layer type (``is_rope_parameters_nested``)
    return [params]


def _without_derived(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` (flat or nested per layer type) without :data:`_ROPE_DERIVED` keys."""
    return {k: (_without_derived(v) if isinstance(v, Mapping) else v)
            for k, v in params.items() if k not in _ROPE_DERIVED}


#: ``load_format`` values that read the same checkpoint files into the same weights (vLLM 0.33
#: ``LoadConfig.load_format``): engines on these share keys. ``dummy`` (random weights) and every
#: other format (gguf, bitsandbytes, mistral, tensorizer, sharded_state, ipc_cache, plugins)
#: keeps its own name, so it shares only with itself.
_CHECKPOINT_READERS = frozenset({"auto", "safetensors", "pt", "npcache", "fastsafetensors",
                                 "instanttensor", "runai_streamer"})


def weights_source(load_config: Any) -> str | None:
    """Where the weights come from: "checkpoint" for the plain readers, else the load format
    by name (None: no load config, e.g. unit tests)."""
    if load_config is None:
        return None
    fmt = getattr(load_config, "load_format", None)
    name = getattr(fmt, "value", fmt)
    name = str(name).lower() if name is not None else "auto"
    return "checkpoint" if name in _CHECKPOINT_READERS else name


#: The value layout (impl/kv_layout.py): per layer, the block's logical [H, N, C] page, kernel
#: blocks merged along N, padding excluded -- independent of kernel-block split and strides.
PAYLOAD_FORMAT = "layer-pages-HNC/1"


#: ``KVCacheSpec`` fields a later supported vLLM release added, with the value that reproduces
#: the earlier release's page layout. At that value a field is left out of the digest, so
#: engines of both releases that lay their pages out alike share keys and values (a rolling
#: upgrade keeps the store, docs/deploy.md); any other value changes the digest (a miss).
#: vLLM 0.34 ``v1/kv_cache_interface.py``: ``AttentionSpec.kv_head_major_slots`` (False: 0.33's
#: slot order), ``MambaSpec.state_alignment`` (1: states packed as 0.33 packs them;
#: ``MambaSpec.state_content_size_bytes`` rounds each up to it),
#: ``MLAAttentionSpec.non_causal_multi_token_decode`` (False: 0.33's decode).
LAYOUT_NEUTRAL_FIELDS: Mapping[str, Any] = {
    "kv_head_major_slots": False,
    "state_alignment": 1,
    "non_causal_multi_token_decode": False,
}


#: ``KVCacheSpec`` fields that only place blocks in memory, never decide a stored byte (the
#: payload is each layer's logical page, padding excluded): ``page_size_padded`` (a page padded
#: to the largest group's) and ``block_stride_alignment`` (vLLM 0.33 and 0.34
#: ``v1/kv_cache_interface.py``: "Required byte alignment between physical blocks", read only by
#: ``get_block_stride_alignment`` when the buffer is laid out; 0.34's
#: ``MambaBase.get_kv_cache_spec`` sets it to ``state_alignment``, 1 by default, where 0.33
#: leaves it None: the same layout). Engines that differ only there hold interchangeable values.
PHYSICAL_PLACEMENT_FIELDS = ("page_size_padded", "block_stride_alignment")


def spec_parts(spec: Any) -> Any:
    """A group's spec as the fingerprint sees it: every field but the
    :data:`PHYSICAL_PLACEMENT_FIELDS` (placement is never stored, so engines that place blocks
    differently hold interchangeable values) and the :data:`LAYOUT_NEUTRAL_FIELDS` that hold
    their neutral value."""
    canon = _canon(resolve_spec(spec))
    if isinstance(canon, dict):
        for name in PHYSICAL_PLACEMENT_FIELDS:
            canon.pop(name, None)
        for name, neutral in LAYOUT_NEUTRAL_FIELDS.items():
            if name in canon and canon[name] == neutral:
                del canon[name]
    return canon


def layout_parts(vllm_config: Any, kv_cache_config: Any, geo: Any) -> dict[str, Any]:
    """Everything :class:`Fingerprint` covers, from vLLM's config alone (both roles)."""
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    pp = par.pipeline_parallel_size
    groups = []
    for gid in geo.core_group_ids:
        g = kv_cache_config.kv_cache_groups[gid]
        # With pipeline parallelism each stage holds other layers (the scheduler sees stage 0's
        # names); the stage's layers then follow from the model, pp size and partition.
        names = sorted(g.layer_names) if pp == 1 else None
        groups.append({"spec": spec_parts(g.kv_cache_spec), "layers": names})
    return {
        "model": model_identity(vllm_config.model_config),
        "weights": weights_source(getattr(vllm_config, "load_config", None)),
        "kv_cache_dtype": getattr(cache, "cache_dtype", None),
        # Layers kept in the model dtype under a quantized KV cache (their bytes differ).
        "kv_cache_dtype_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", None)
                                             or []) or None,
        "mamba_cache_dtype": getattr(cache, "mamba_cache_dtype", None),
        "mamba_ssm_cache_dtype": getattr(cache, "mamba_ssm_cache_dtype", None),
        "groups": groups,
        "tp": par.tensor_parallel_size,
        "pp": pp,
        "dcp": getattr(par, "decode_context_parallel_size", 1),
        "pp_partition": os.environ.get("VLLM_PP_LAYER_PARTITION"),
        "hash_algo": getattr(cache, "prefix_caching_hash_algo", None),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "geometry": geometry_parts(geo),
        "payload": PAYLOAD_FORMAT,
    }


def geometry_parts(geo: Any) -> dict[str, Any]:
    return {"block_sizes": list(geo.block_sizes), "mamba": list(geo.is_mamba),
            "h": geo.hash_block_size, "lcm": geo.scheduler_block_size,
            "partial_hits": geo.partial_hits, "eagle": geo.use_eagle}


def fingerprint_from_vllm(vllm_config: Any, kv_cache_config: Any, geo: Any) -> Fingerprint:
    """The engine's fingerprint (identical on the scheduler and every worker)."""
    return digest_of(layout_parts(vllm_config, kv_cache_config, geo))


def geometry_fingerprint(geo: Any) -> Fingerprint:
    """A fingerprint of the block geometry alone: for parts driven without a ``VllmConfig``
    (the conformance adapter, unit tests), where no model or dtype is known."""
    return digest_of({"geometry": geometry_parts(geo)})


def expected_layer_bytes(spec: Any) -> int | None:
    """Bytes of one block of one layer as the spec defines them, unpadded (None: unknown)."""
    spec = resolve_spec(spec)
    for name in ("real_page_size_bytes", "page_size_bytes"):
        try:
            val = getattr(spec, name)
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(val, int):
            return val
    return None


def spec_dtypes(spec: Any) -> tuple[Any, ...]:
    """The tensor dtypes a layer of this spec holds (one per state tensor for Mamba)."""
    spec = resolve_spec(spec)
    if getattr(spec, "dtypes", None):
        return tuple(spec.dtypes)
    dt = getattr(spec, "dtype", None)
    return (dt,) if dt is not None else ()


def expected_page_shape(spec: Any) -> tuple[int, int, int] | None:
    """``(H, N, C bytes)`` of one block of one layer's logical page, as vLLM 0.33's
    ``compute_layer_kv_cache_shape_bytes`` derives it (None: the spec has no page view)."""
    spec = resolve_spec(spec)
    try:
        return (spec.num_heads, spec.num_states, spec.state_content_size_bytes)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _itemsize(dtype: Any) -> int | None:
    return getattr(dtype, "itemsize", None)


def check_tensors(layer_bytes: Mapping[str, int],
                  layer_page_shapes: Mapping[str, tuple[int, ...] | None],
                  layer_itemsizes: Mapping[str, Sequence[int]],
                  groups: Sequence[tuple[Sequence[str], Any]]) -> list[str]:
    """Problems where the registered KV tensors disagree with the specs the fingerprint covers.

    ``layer_bytes[name]``: bytes of one block of that layer as registered (all its tensors,
    padding excluded); ``layer_page_shapes[name]``: the ``(H, N, C bytes)`` of its 4D page view
    (None: not one); ``layer_itemsizes[name]``: the element sizes it was registered with;
    ``groups``: (layer names, spec) per stored group. A typed view's element size must be one of
    the spec's dtypes; a 1-byte view is vLLM's raw page (Mamba layers are registered as ``int8``
    page views, ``MambaBase.bind_kv_cache``) and is checked by its shape alone. Layers this rank
    does not hold (pipeline parallelism) are skipped.
    """
    problems: list[str] = []
    for names, spec in groups:
        want_bytes = expected_layer_bytes(spec)
        want_shape = expected_page_shape(spec)
        want_sizes = {s for s in map(_itemsize, spec_dtypes(spec)) if s is not None}
        kind = type(resolve_spec(spec)).__name__
        for name in names:
            if name not in layer_bytes:
                continue
            got = layer_bytes[name]
            if want_bytes is not None and got != want_bytes:
                problems.append(f"KV cache layer {name!r}: one block holds {got} bytes but its "
                                f"{kind} says {want_bytes}")
            shape = layer_page_shapes.get(name)
            if want_shape is not None and shape is not None and tuple(shape) != want_shape:
                problems.append(f"KV cache layer {name!r}: page [H, N, C bytes] {list(shape)} "
                                f"but its {kind} says {list(want_shape)}")
            sizes = {s for s in layer_itemsizes.get(name, ()) if s > 1}
            if want_sizes and sizes and not sizes <= want_sizes:
                problems.append(f"KV cache layer {name!r}: element sizes {sorted(sizes)} but its "
                                f"{kind} dtypes have {sorted(want_sizes)}")
    return problems
