"""Start-up validation: one clear message per problem, unknown keys rejected."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tailproof.impl.config import ConfigError, StoreGeometry, check_geometry, parse_settings


def test_defaults() -> None:
    s = parse_settings({}, "kv_both")
    assert s.store == "memory" and s.is_producer and s.enable_lookup and s.load_async
    assert s.store_config == {"backend": "memory"}


def test_store_settings_are_flat_and_passed_through() -> None:
    s = parse_settings({"store": "mooncake", "master_address": "127.0.0.1:50051",
                        "protocol": "tcp"}, "kv_producer")
    assert s.store_config == {"backend": "mooncake", "master_address": "127.0.0.1:50051",
                              "protocol": "tcp"}
    assert s.is_producer and not s.is_consumer


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_settings({"stor": "memory", "put_batch_size": 0, "enable_lookup": "yes",
                        "namespace": "a@b"}, "kv_sideways")
    text = str(ei.value)
    assert len(ei.value.problems) == 5
    for needle in ("unknown key 'stor'", "put_batch_size must be positive",
                   "enable_lookup must be bool", "namespace", "kv_role 'kv_sideways'"):
        assert needle in text


def test_store_settings_checked_by_the_store() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_settings({"store": "mooncake"}, "kv_both")
    assert "master_address" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        parse_settings({"store": "redis"}, "kv_both")
    assert "store 'redis' is not one of memory, mooncake" in str(ei.value)


def test_bool_is_not_a_count() -> None:
    with pytest.raises(ConfigError):
        parse_settings({"put_batch_size": True}, None)


def _geom(sizes: tuple[int, ...], h: int, lcm: int) -> StoreGeometry:
    return StoreGeometry(core_group_ids=tuple(range(len(sizes))), block_sizes=sizes,
                         is_mamba=(False,) * (len(sizes) - 1) + (True,), hash_block_size=h,
                         scheduler_block_size=lcm, partial_hits=True, use_eagle=False)


def test_h_must_divide_every_block_size() -> None:
    probs = check_geometry(_geom((16, 24), 5, 48))
    assert sum("does not divide" in p for p in probs) == 2
    assert check_geometry(_geom((16, 32), 4, 32)) == []
    assert "not the lcm" in " ".join(check_geometry(_geom((16, 32), 4, 64)))


def test_eagle_margin_and_alignment() -> None:
    g = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                      hash_block_size=4, scheduler_block_size=16, partial_hits=True, use_eagle=True,
                      eagle_group_ids=frozenset({0, 1}))
    assert g.alignment == 4 and g.eagle_proof_margin(0) == 4 and g.eagle_proof_margin(1) == 0
    assert g.align_lookup_length(45) == 44


def _problems(extra: dict) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_settings(extra, "kv_both")
    return ei.value.problems


def test_settings_of_the_other_store_are_rejected_by_name() -> None:
    (p,) = _problems({"store": "memory", "master_address": "127.0.0.1:50051"})
    assert "master_address" in p and "'mooncake' store" in p
    (p,) = _problems({"store": "mooncake", "master_address": "127.0.0.1:50051",
                      "capacity_bytes": "1GB"})
    assert "capacity_bytes" in p and "'memory' store" in p


def test_one_size_syntax_for_every_size_key() -> None:
    for text in ("64MB", "64 MiB", 64 << 20, "65536K"):
        assert parse_settings({"staging_buffer_bytes": text}, None).staging_buffer_bytes == 64 << 20
    s = parse_settings({"capacity_bytes": "64MB"}, None)
    assert s.store_config["capacity_bytes"] == "64MB"
    (p,) = _problems({"staging_buffer_bytes": "lots"})
    assert p.startswith("staging_buffer_bytes: ")
    (p,) = _problems({"staging_buffer_bytes": "0MB"})
    assert "staging_buffer_bytes must be positive" in p


@pytest.mark.parametrize("key,store", [("staging_buffer_bytes", "memory"),
                                       ("capacity_bytes", "memory"),
                                       ("global_segment_size", "mooncake"),
                                       ("local_buffer_size", "mooncake")])
def test_sizes_beyond_the_machines_memory_are_one_clear_line(key: str, store: str) -> None:
    extra = {"store": store, key: "1000000TB"}
    if store == "mooncake":
        extra["master_address"] = "127.0.0.1:50051"
    (p,) = _problems(extra)
    assert key in p and "more than this machine's memory" in p


@pytest.mark.parametrize("addr", ["127.0.0.1:50051\n", " 127.0.0.1:50051", "127.0.0.1:50051 ",
                                  "bad host:1", "127.0.0.1:0", "127.0.0.1", "[::1:50051",
                                  "-leading.dash:1", "a..b:1"])
def test_master_address_is_validated_strictly(addr: str) -> None:
    (p,) = _problems({"store": "mooncake", "master_address": addr})
    assert "master_address" in p


@pytest.mark.parametrize("addr", ["127.0.0.1:50051", "[::1]:50051", "mooncake-0.svc:50051",
                                  "h:1"])
def test_good_master_addresses(addr: str) -> None:
    s = parse_settings({"store": "mooncake", "master_address": addr}, None)
    assert s.store_config["master_address"] == addr


def test_local_hostname_and_metadata_server_are_validated() -> None:
    base = {"store": "mooncake", "master_address": "127.0.0.1:1"}
    (p,) = _problems({**base, "local_hostname": "127.0.0.1\n"})
    assert p.startswith("store setting local_hostname")
    (p,) = _problems({**base, "metadata_server": "http://x:1/metadata\n"})
    assert "metadata_server" in p
    assert parse_settings({**base, "metadata_server": "http://127.0.0.1:8080/metadata"}, None)


def test_reuse_extension_settings_validated() -> None:
    s = parse_settings({"turn_end_checkpoints": True, "checkpoint_slots": 8,
                        "checkpoint_reserve_blocks": 0, "decode_boundary_saves": True}, None)
    assert s.turn_end_checkpoints and s.decode_boundary_saves and s.reuse_extension
    assert (s.checkpoint_slots, s.checkpoint_reserve_blocks) == (8, 0)
    d = parse_settings({}, None)
    assert not d.reuse_extension and (d.checkpoint_slots, d.checkpoint_reserve_blocks) == (32, 4)
    with pytest.raises(ConfigError) as ei:
        parse_settings({"turn_end_checkpoints": 1, "checkpoint_slots": 4097,
                        "checkpoint_reserve_blocks": -1, "decode_boundary_saves": "no"}, None)
    assert len(ei.value.problems) == 4
    for needle in ("turn_end_checkpoints must be bool", "checkpoint_slots must be in 1..4096",
                   "checkpoint_reserve_blocks must be >= 0", "decode_boundary_saves must be bool"):
        assert needle in str(ei.value)
    with pytest.raises(ConfigError, match="checkpoint_slots must be in"):
        parse_settings({"checkpoint_slots": 0}, None)


def test_reuse_extension_refuses_speculation_and_windows() -> None:
    """docs/reuse.md, Limits: speculative decoding, Mamba speculative blocks and sliding
    windows are refused with the extension on (each problem names the setting)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from tailproof.impl.config import resolve_reuse_extension

    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((3,), (5,)), dtypes=(torch.float32,) * 2,
                      mamba_cache_mode="align", num_speculative_blocks=2)
    kvc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=fa),
                                           SimpleNamespace(kv_cache_spec=mamba)])
    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                        hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                        use_eagle=False, window_group_ids=frozenset({0}))
    vc = SimpleNamespace(speculative_config=object())
    on = parse_settings({"decode_boundary_saves": True, "junction_checkpoints": "auto"}, None)
    resolved, probs, notes = resolve_reuse_extension(on, geo, vc, kvc)
    assert len(probs) == 3 and all(p.startswith("decode_boundary_saves=true") for p in probs)
    # turn_end_checkpoints (default false) stays off silently; junction_checkpoints (auto)
    # goes off, noted
    assert not resolved.turn_end_checkpoints and not resolved.junction_checkpoints
    assert len(notes) == 1 and notes[0].startswith("junction_checkpoints (auto) is off: ")
    assert not parse_settings({}, None).reuse_extension  # off unless asked
    every_auto = {k: "auto" for k in ("turn_end_checkpoints", "decode_boundary_saves",
                                      "junction_checkpoints")}
    auto, probs, notes = resolve_reuse_extension(parse_settings(every_auto, None), geo, vc, kvc)
    assert probs == [] and not auto.reuse_extension and len(notes) == 3
    with pytest.raises(ConfigError, match='junction_checkpoints must be bool or "auto"'):
        parse_settings({"junction_checkpoints": "yes"}, None)
    plain = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                          hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                          use_eagle=False)
    kvc.kv_cache_groups[1].kv_cache_spec = MambaSpec(
        block_size=16, shapes=((3,), (5,)), dtypes=(torch.float32,) * 2,
        mamba_cache_mode="align")
    sc = SimpleNamespace(speculative_config=None)
    assert resolve_reuse_extension(on, plain, sc, kvc)[1] == []
    auto, probs, notes = resolve_reuse_extension(parse_settings(every_auto, None), plain, sc,
                                                 kvc)
    assert probs == notes == [] and auto.turn_end_checkpoints and auto.decode_boundary_saves
    assert auto.junction_checkpoints  # auto: on where supported
    pure = replace(plain, is_mamba=(False, False))
    auto, _, notes = resolve_reuse_extension(parse_settings(every_auto, None), pure, sc, kvc)
    assert not auto.reuse_extension and "no Mamba group" in notes[0]


def test_device_junctions_needs_junction_checkpoints() -> None:
    """``device_junctions`` keys the junction stops the junction hook sets: without
    ``junction_checkpoints`` it cannot act, so true is refused and "auto" is off, noted
    (it used to resolve on and do nothing, silently)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from tailproof.impl.config import resolve_reuse_extension

    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((3,), (5,)), dtypes=(torch.float32,) * 2,
                      mamba_cache_mode="align")
    kvc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=fa),
                                           SimpleNamespace(kv_cache_spec=mamba)])
    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                        hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                        use_eagle=False)
    sc = SimpleNamespace(speculative_config=None)
    asked = parse_settings({"device_junctions": True, "junction_checkpoints": False}, None)
    resolved, probs, _ = resolve_reuse_extension(asked, geo, sc, kvc)
    assert not resolved.device_junctions
    assert probs == ["device_junctions=true needs junction_checkpoints: junction_checkpoints is "
                     "off (device_junctions keys the junction stops it sets)"]
    auto = parse_settings({"device_junctions": "auto", "junction_checkpoints": False}, None)
    resolved, probs, notes = resolve_reuse_extension(auto, geo, sc, kvc)
    assert probs == [] and not resolved.device_junctions
    assert notes == ["device_junctions (auto) is off: junction_checkpoints is off "
                     "(device_junctions keys the junction stops it sets)"]
    both = parse_settings({"device_junctions": True, "junction_checkpoints": True}, None)
    resolved, probs, _ = resolve_reuse_extension(both, geo, sc, kvc)
    assert probs == [] and resolved.device_junctions and resolved.junction_checkpoints


def test_decode_boundary_saves_use_vllms_decode_checkpoints_where_it_has_them() -> None:
    """Rule 5 on a release that stores decode checkpoints itself (vLLM 0.34) becomes
    ``save_decode_cache`` (rule 5's own attention puts off); elsewhere, for a consumer, or
    with the part off, nothing changes."""
    from tailproof.impl.config import Settings, native_decode_checkpoints

    on = Settings(decode_boundary_saves=True)
    got, note = native_decode_checkpoints(on, native=True)
    assert (got.save_decode_cache, got.native_decode_boundaries, got.decode_boundary_saves) \
        == (True, True, True) and note is not None
    for settings, native in ((on, False), (Settings(), True),
                             (Settings(decode_boundary_saves=True, kv_role="kv_consumer"), True)):
        assert native_decode_checkpoints(settings, native) == (settings, None)
    with pytest.raises(ConfigError, match="native_decode_boundaries"):
        parse_settings({"native_decode_boundaries": True}, None)  # not a user key


def test_decode_checkpoints_retain_a_state_at_every_block_as_vllm_sets_it() -> None:
    """vLLM 0.34's Mooncake override, mirrored: with ``save_decode_cache`` and a Mamba group the
    core's default sparse retention (0) becomes the scheduler block; a retention the user chose
    (dense None, or an interval) stays, and so does everything on 0.33."""
    from types import SimpleNamespace

    from tailproof.impl.config import Settings, decode_checkpoint_retention

    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(64, 64), is_mamba=(False, True),
                        hash_block_size=16, scheduler_block_size=64, partial_hits=True,
                        use_eagle=False, num_blocks=8)
    saves = Settings(save_decode_cache=True)
    for settings, native, interval, want in ((saves, True, 0, 64), (saves, True, None, None),
                                             (saves, True, 128, 128), (saves, False, 0, 0),
                                             (Settings(), True, 0, 0)):
        kvc = SimpleNamespace(prefix_cache_retention_interval=interval)
        assert decode_checkpoint_retention(settings, geo, kvc, native) == (want != interval)
        assert kvc.prefix_cache_retention_interval == want
    attention_only = replace(geo, block_sizes=(64,), is_mamba=(False,), core_group_ids=(0,))
    kvc = SimpleNamespace(prefix_cache_retention_interval=0)
    assert not decode_checkpoint_retention(saves, attention_only, kvc, True)
