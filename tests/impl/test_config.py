"""Start-up validation: one clear message per problem, unknown keys rejected."""

from __future__ import annotations

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
                         lcm_block_size=lcm, partial_hits=True, use_eagle=False)


def test_h_must_divide_every_block_size() -> None:
    probs = check_geometry(_geom((16, 24), 5, 48))
    assert sum("does not divide" in p for p in probs) == 2
    assert check_geometry(_geom((16, 32), 4, 32)) == []
    assert "not the lcm" in " ".join(check_geometry(_geom((16, 32), 4, 64)))


def test_eagle_margin_and_alignment() -> None:
    g = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                      hash_block_size=4, lcm_block_size=16, partial_hits=True, use_eagle=True,
                      eagle_group_ids=frozenset({0, 1}))
    assert g.alignment == 4 and g.eagle_proof_margin(0) == 4 and g.eagle_proof_margin(1) == 0
    assert g.align_lookup_length(45) == 44
