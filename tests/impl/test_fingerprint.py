"""Keys name the bytes: engines share keys exactly when their KV bytes are interchangeable.

The matrix starts from a real vLLM 0.33 config of the tiny hybrid model (``engine_sim``) and
changes one thing at a time; every change gives another fingerprint, and a load across it is a
miss (fail closed: nothing reaches the KV cache), never a load of foreign bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tailproof.conformance.harness.adapters.runner_sim import GroupShape, SimRunner
from tailproof.impl.config import Settings, StoreGeometry, geometry_from_vllm
from tailproof.impl.fingerprint import Fingerprint, check_tensors, fingerprint_from_vllm
from tailproof.impl.keys import KeySpace, parse_key
from tailproof.impl.meta import BoundaryPut, LoadJob, StoreJob, TailKeyBoundary, TailproofMeta
from tailproof.impl.stores import MemoryStore
from tailproof.impl.worker_side import WorkerSide

pytestmark = pytest.mark.vllm

H, NB = 4, 32
TOKENS = list(range(100, 160))
HASHES = [bytes([i]) * 8 for i in range(len(TOKENS) // H)]


def _base() -> tuple[Any, Any, StoreGeometry]:
    from engine_sim import GROUPS, kv_cache_config, vllm_config

    vc = vllm_config({"store": "memory"}, h=H)
    kvc = kv_cache_config(NB, GROUPS, H)
    return vc, kvc, geometry_from_vllm(vc, kvc)


def _set(obj: Any, **attrs: Any) -> Any:
    out = copy.copy(obj)
    for k, v in attrs.items():
        object.__setattr__(out, k, v)  # vLLM's config dataclasses validate on assignment
    return out


def _model(**kw: Any) -> Any:
    """A real ``ModelConfig`` of the tiny model (vLLM resolves ``hf_overrides`` into it)."""
    from vllm.config import ModelConfig

    from tailproof.conformance.tools.capture_engine import tiny_hybrid

    tiny_hybrid.register()
    return ModelConfig(model=str(tiny_hybrid.MODEL_DIR), skip_tokenizer_init=True,
                       dtype="float32", max_model_len=4096, **kw)


def _load(**kw: Any) -> Any:
    from vllm.config import LoadConfig

    return LoadConfig(**kw)


def _rope_in_config_file(model: Any) -> Any:
    """The same RoPE change reached without hf_overrides (another config.json at the same
    path): the resolved text config is what counts, not where it came from."""
    model = copy.copy(model)
    text = copy.copy(model.hf_text_config)
    text.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    object.__setattr__(model, "hf_text_config", text)
    return model


def _other_layer_names(kvc: Any) -> Any:
    kvc = copy.deepcopy(kvc)
    kvc.kv_cache_groups[0].layer_names = ["model.layers.7.attn", "model.layers.9.attn"]
    return kvc


def _other_head_size(kvc: Any) -> Any:
    kvc = copy.deepcopy(kvc)
    kvc.kv_cache_groups[0].kv_cache_spec = replace(kvc.kv_cache_groups[0].kv_cache_spec,
                                                   head_size=8)
    return kvc


# Each variant: the part of the engine it changes and how (the part's old value in, new out).
VARIANT_CHANGES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "same model again": ("model", lambda m: m),
    "hf_overrides rope_theta": ("model", lambda _: _model(hf_overrides={"rope_theta": 500000.0})),
    "rope_theta from the config file": ("model", _rope_in_config_file),
    "rope_scaling": ("model", lambda _: _model(
        hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})),
    "other hf_overrides": ("model", lambda _: _model(hf_overrides={"rms_norm_eps": 1e-5})),
    "load_format dummy": ("load", lambda _: _load(load_format="dummy")),
    "load_format gguf": ("load", lambda _: _load(load_format="gguf")),
    "model_weights": ("model", lambda m: _set(m, model_weights="s3://bucket/other-weights")),
    "code revision": ("model", lambda m: _set(m, code_revision="abc123")),
    "model path": ("model", lambda m: _set(m, model="/models/other")),
    "revision": ("model", lambda m: _set(m, revision="v2")),
    "dtype": ("model", lambda m: _set(m, dtype=torch.bfloat16)),
    "kv cache dtype": ("cache", lambda c: _set(c, cache_dtype="fp8")),
    "kv cache skip layers": ("cache", lambda c: _set(
        c, kv_cache_dtype_skip_layers=["model.layers.1.attn"])),
    "mamba ssm dtype": ("cache", lambda c: _set(c, mamba_ssm_cache_dtype="float32")),
    "layer names": ("kvc", _other_layer_names),
    "tensor shape": ("kvc", _other_head_size),
    "tp size": ("par", lambda p: _set(p, tensor_parallel_size=2)),
    "pp size": ("par", lambda p: _set(p, pipeline_parallel_size=2)),
    "hash algorithm": ("cache", lambda c: _set(c, prefix_caching_hash_algo="sha256_cbor")),
    "hash seed": ("env", lambda mp: mp.setenv("PYTHONHASHSEED", "1234")),
    "h": ("geo", lambda g: replace(g, hash_block_size=8)),
    "block size": ("geo", lambda g: replace(g, block_sizes=(32, 32), scheduler_block_size=32)),
}


def _variant(name: str, monkeypatch: pytest.MonkeyPatch) -> Fingerprint:
    vc, kvc, geo = _base()
    parts = {"model": vc.model_config, "cache": vc.cache_config, "par": vc.parallel_config,
             "load": _load(), "kvc": kvc, "geo": geo}
    part, change = VARIANT_CHANGES[name]
    if part == "env":
        change(monkeypatch)
    else:
        parts[part] = change(parts[part])
    ns = SimpleNamespace(model_config=parts["model"], cache_config=parts["cache"],
                         parallel_config=parts["par"], load_config=parts["load"])
    return fingerprint_from_vllm(ns, parts["kvc"], parts["geo"])


DIFFERENCES = ["model path", "revision", "dtype", "kv cache dtype", "kv cache skip layers",
               "mamba ssm dtype",
               "layer names", "tensor shape", "tp size", "pp size", "hash algorithm",
               "hash seed", "h", "block size", "hf_overrides rope_theta",
               "rope_theta from the config file", "rope_scaling", "other hf_overrides",
               "load_format dummy", "load_format gguf", "model_weights", "code revision"]


def _worker(store: MemoryStore, fp: Fingerprint) -> tuple[WorkerSide, SimRunner]:
    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                    hash_block_size=H, scheduler_block_size=16, partial_hits=True, use_eagle=False,
                    num_blocks=NB)
    runner = SimRunner([GroupShape("full_attention", 16, 2), GroupShape("mamba", 16, 2)], NB)
    w = WorkerSide(Settings(namespace="shared"), geo, store, 0, 1, fingerprint=fp,
                   keep_load_outcomes=True)
    w.register_kv_caches(runner.kv, runner.layer_names)
    return w, runner


def _save_then_load(fp_writer: Fingerprint, fp_reader: Fingerprint) -> tuple[bool, Any, Any]:
    """Writer saves a 44-token prefix; reader (same namespace) loads it into fresh blocks."""
    store = MemoryStore()
    w, runner = _worker(store, fp_writer)
    tables = ([1, 2, 3], [0, 0, 6])
    runner.forward("A", TOKENS, 0, 44, tables)
    w.wait_for_save(TailproofMeta(stores=[StoreJob(
        store_job_id=0, req_id="A", token_len_chunk=32, block_ids=tables, block_hashes=HASHES,
        boundary_puts=[BoundaryPut(0, 3, 44), BoundaryPut(1, 6, 44)])]))
    assert w.wait_idle(30.0)  # the put runs off the step, on the sender thread
    r, rrun = _worker(store, fp_reader)
    ctab = ([7, 8, 9], [0, 0, 10])
    before = {k: v.clone() for k, v in rrun.kv.items() if isinstance(v, torch.Tensor)}
    load = LoadJob(req_id="B", block_ids=ctab, block_hashes=HASHES, vllm_cached_tokens=0,
                   kvpool_cached_tokens=44,
                   tail_key_boundaries=(TailKeyBoundary(0, 44), TailKeyBoundary(1, 44)))
    r.start_load(TailproofMeta(loads=[load]))
    assert r.wait_idle(30.0)
    ok = r.load_ok.pop("B")
    return ok, (r, rrun, ctab), before


def test_same_model_twice_shares_keys_and_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _variant("same model again", monkeypatch), _variant("same model again", monkeypatch)
    assert a.digest == b.digest and len(a.digest) == 16
    ok, (_, rrun, ctab), _ = _save_then_load(a, b)
    assert ok and rrun.check("B", TOKENS, 0, 44, ctab) == []


def test_rope_overrides_reach_the_fingerprint_resolved() -> None:
    """vLLM resolves ``hf_overrides`` into the text config; the digest reads it there."""
    from tailproof.impl.fingerprint import model_identity

    plain, over = model_identity(_model()), model_identity(_model(hf_overrides={
        "rope_theta": 500000.0}))
    assert plain["rope"] == {"max_position_embeddings": 4096}
    assert over["rope"]["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}


def test_a_key_vllm_derives_into_rope_parameters_does_not_split_the_roles() -> None:
    """``gpt_j`` writes ``partial_rotary_factor`` into the config's ``rope_parameters`` while
    it builds the model: a worker holding the model and the scheduler must still agree."""
    from tailproof.impl.fingerprint import rope_parts

    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                          rotary_dim=8)
    before = rope_parts(cfg)
    cfg.rope_parameters["partial_rotary_factor"] = 0.5  # what GPTJAttention.__init__ does
    assert rope_parts(cfg) == before
    cfg.rotary_dim = 16  # the attribute it is derived from still counts
    assert rope_parts(cfg) != before


def test_max_model_len_counts_only_where_longrope_picks_its_factors() -> None:
    """LongRoPE rotates with its long factors at every position once ``max_model_len``
    exceeds ``original_max_position_embeddings`` (``Phi3LongRoPEScaledRotaryEmbedding``):
    there, and only there, ``max_model_len`` changes cached K bytes."""
    from tailproof.impl.fingerprint import rope_parts

    long = SimpleNamespace(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [2.0],
        "original_max_position_embeddings": 4096}, max_position_embeddings=131072)
    assert rope_parts(long, 4096) == rope_parts(long, 2048)  # short factors both
    assert rope_parts(long, 8192) == rope_parts(long, 131072)  # long factors both
    assert rope_parts(long, 4096) != rope_parts(long, 8192)
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert rope_parts(plain, 4096) == rope_parts(plain, 131072)
    nested = SimpleNamespace(rope_parameters={"full_attention": long.rope_parameters,
                                              "sliding_attention": plain.rope_parameters})
    assert rope_parts(nested, 4096) != rope_parts(nested, 8192)


@pytest.mark.parametrize("change", ["max_num_seqs", "pool size", "load_format safetensors",
                                    "max_num_batched_tokens", "seed"])
def test_settings_that_do_not_change_bytes_share_keys(change: str) -> None:
    """Engines whose KV bytes are interchangeable keep one fingerprint (and load each other's
    values): scheduling limits, the store's size, another reader of the same checkpoint."""
    from engine_sim import GROUPS, kv_cache_config, vllm_config
    from vllm.config import LoadConfig

    kvc = kv_cache_config(NB, GROUPS, H)
    base = vllm_config({"store": "memory", "capacity_bytes": 1 << 26}, h=H)
    if change == "pool size":
        other = vllm_config({"store": "memory", "capacity_bytes": 1 << 28}, h=H)
    elif change == "max_num_batched_tokens":
        other = vllm_config({"store": "memory", "capacity_bytes": 1 << 26}, h=H,
                            max_batched=512)
    else:
        other = vllm_config({"store": "memory", "capacity_bytes": 1 << 26}, h=H)
        if change == "max_num_seqs":
            object.__setattr__(other.scheduler_config, "max_num_seqs", 3)
        elif change == "seed":
            other.model_config = _set(other.model_config, seed=7)
        else:
            other.load_config = LoadConfig(load_format="safetensors")
    a = fingerprint_from_vllm(base, kvc, geometry_from_vllm(base, kvc))
    b = fingerprint_from_vllm(other, kvc, geometry_from_vllm(other, kvc))
    assert a.digest == b.digest, change
    ok, (_, rrun, ctab), _ = _save_then_load(a, b)
    assert ok and rrun.check("B", TOKENS, 0, 44, ctab) == []


@pytest.mark.parametrize("difference", DIFFERENCES)
def test_each_difference_is_another_fingerprint_and_a_miss(
        difference: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _variant("same model again", monkeypatch)
    other = _variant(difference, monkeypatch)
    assert other.digest != base.digest
    ok, (reader, rrun, _), before = _save_then_load(base, other)
    assert not ok  # fail closed ...
    assert reader.metrics.c.total("get_fail_miss") >= 1  # ... as a miss, not a bad value
    for name, t in before.items():  # ... and not one byte reached the KV cache
        assert torch.equal(rrun.kv[name], t)


def test_tp_rank_and_pp_rank_are_separate_in_the_key() -> None:
    tp2 = KeySpace("ns", "0" * 16, tp_size=2)  # TP=2 x PP=1: rank 1 = tp rank 1
    pp2 = KeySpace("ns", "0" * 16, tp_size=1)  # TP=1 x PP=2: rank 1 = pp rank 1
    k_tp, k_pp = tp2.key(1, 0, b"\x01"), pp2.key(1, 0, b"\x01")
    assert k_tp != k_pp
    assert (parse_key(k_tp).tp_rank, parse_key(k_tp).pp_rank) == (1, 0)
    assert (parse_key(k_pp).tp_rank, parse_key(k_pp).pp_rank) == (0, 1)


def test_a_key_is_its_head_and_the_hash() -> None:
    """Lookups build keys from ``KeySpace.head`` (once per rank, group and epoch)."""
    ks = KeySpace("ns", "0" * 16, tp_size=2)
    for rank in range(4):
        for group in range(3):
            for epoch in ("0", "e1"):
                assert ks.head(rank, group, epoch) + "ab01" == ks.key(rank, group, b"\xab\x01",
                                                                      epoch)
    assert parse_key(ks.head(3, 2, "e1") + "ff").pp_rank == 1


def test_scheduler_and_worker_compute_the_same_keys() -> None:
    """Both roles of a real connector derive one fingerprint from vLLM's config alone."""
    from engine_sim import Engine

    eng = Engine({"store": "memory", "namespace": "fp-test"})
    try:
        wc = eng.workers[0][0]
        assert wc.fingerprint.digest == eng.conn.fingerprint.digest
        lookup_key = eng.conn.scheduler_side.lookup_client.keys.key(0, 1, b"\xab")
        assert wc.worker_side.key(1, b"\xab") == lookup_key
        assert parse_key(lookup_key).fingerprint == eng.conn.fingerprint.digest
    finally:
        eng.shutdown()


def test_worker_rejects_tensors_that_disagree_with_the_config() -> None:
    _, kvc, _ = _base()
    groups = [(g.layer_names, g.kv_cache_spec) for g in kvc.kv_cache_groups]
    fa, mamba = kvc.kv_cache_groups[0].layer_names, kvc.kv_cache_groups[1].layer_names
    good_bytes = {fa[0]: 2 * 16 * 4 * 4, fa[1]: 2 * 16 * 4 * 4,
                  mamba[0]: (3 + 5) * 4, mamba[1]: (3 + 5) * 4}
    shapes = {fa[0]: (1, 16, 32), fa[1]: (1, 16, 32), mamba[0]: (1, 1, 32), mamba[1]: (1, 1, 32)}
    # vLLM 0.33 registers Mamba layers as int8 page views: element size 1 is its raw page.
    sizes = {fa[0]: [4], fa[1]: [4], mamba[0]: [1], mamba[1]: [1]}
    assert check_tensors(good_bytes, shapes, sizes, groups) == []
    bad = check_tensors({**good_bytes, fa[1]: 2 * 16 * 4 * 2}, {**shapes, fa[1]: (1, 16, 16)},
                        {**sizes, fa[1]: [2]}, groups)
    assert len(bad) == 3 and all(repr(fa[1]) in p for p in bad)
    # Same bytes, another page shape (2 heads of half the content): refused by shape.
    bad = check_tensors(good_bytes, {**shapes, fa[0]: (2, 16, 16)}, sizes, groups)
    assert len(bad) == 1 and "[2, 16, 16]" in bad[0]
    # A layer this rank does not hold (pipeline parallelism) is not a problem.
    assert check_tensors({fa[0]: good_bytes[fa[0]]}, shapes, sizes, groups) == []


def test_the_real_registration_passes_the_check() -> None:
    """The tensors vLLM 0.33's own allocation builds (padded int8 Mamba pages, typed fused
    K/V views, two layers per group) pass the check, and the bytes per block are exactly the
    unpadded state / KV bytes (padding is never stored)."""
    from tailproof.impl.kv_layout import KVLayout

    runner = SimRunner([GroupShape("full_attention", 16, 2), GroupShape("mamba", 16, 2)], NB)
    specs = [(g.layer_names, g.kv_cache_spec) for g in runner.specs]
    assert runner.specs[1].kv_cache_spec.page_size_padded == 2 * 16 * 4 * 4  # padded page
    lay = KVLayout(runner.kv, runner.layer_names, NB)
    assert check_tensors(lay.layer_bytes, lay.layer_page_shapes, lay.layer_itemsizes,
                         specs) == []
    assert lay.block_nbytes == [2 * (2 * 16 * 4 * 4), 2 * (3 + 5) * 4]


def test_padding_and_kernel_split_are_not_in_the_fingerprint() -> None:
    """Where blocks sit in memory (page padding, the stride alignment between blocks: 0.33's
    Mamba spec leaves ``block_stride_alignment`` None, 0.34's sets 1) is not in the digest."""
    from vllm.v1.attention.backend import MultipleOf

    from tailproof.impl.fingerprint import spec_parts

    _, kvc, _ = _base()
    for spec in (kvc.kv_cache_groups[0].kv_cache_spec, kvc.kv_cache_groups[1].kv_cache_spec):
        assert spec_parts(spec) == spec_parts(replace(spec, page_size_padded=4096))
        for alignment in (None, 1, 512, MultipleOf(16)):
            assert spec_parts(spec) == spec_parts(replace(spec, block_stride_alignment=alignment))


def test_fields_a_later_release_added_count_only_off_their_neutral_value() -> None:
    """vLLM 0.34's new spec fields (``LAYOUT_NEUTRAL_FIELDS``) at the value that reproduces
    0.33's page layout leave the digest as 0.33 computes it (a rolling upgrade keeps the
    store); any other value is another layout, so another digest (a miss)."""
    import dataclasses

    from tailproof.impl.fingerprint import LAYOUT_NEUTRAL_FIELDS, spec_parts

    _, kvc, _ = _base()
    for spec in (kvc.kv_cache_groups[0].kv_cache_spec, kvc.kv_cache_groups[1].kv_cache_spec):
        canon = spec_parts(spec)
        assert not set(LAYOUT_NEUTRAL_FIELDS) & set(canon)
        present = {f.name for f in dataclasses.fields(spec)} & set(LAYOUT_NEUTRAL_FIELDS)
        for name in present:  # empty on vLLM 0.33, which lacks the fields
            changed = {"kv_head_major_slots": True, "state_alignment": 16,
                       "non_causal_multi_token_decode": True}[name]
            try:
                other = replace(spec, **{name: changed})
            except AssertionError:  # a value the spec's own checks refuse with this shape
                continue
            assert spec_parts(other) != canon, name
