"""Connector settings bounded (issue 20, item 10): queue and batch sizes, the staging total
across threads against this machine's memory, control characters in the namespace, and the
reuse extension's checkpoints asked for without partial hash hits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tailproof.impl import config as cfg
from tailproof.impl.config import ConfigError, StoreGeometry, parse_settings
from tailproof.impl.stores import config as store_cfg


@pytest.mark.parametrize("key, most", [("max_queued_jobs", cfg.MAX_QUEUED_JOBS),
                                       ("put_batch_size", cfg.MAX_PUT_BATCH)])
def test_queue_and_batch_bounded(key: str, most: int) -> None:
    assert getattr(parse_settings({key: most}, None), key) == most
    with pytest.raises(ConfigError, match=f"{key} must be at most {most}, got {1 << 40}"):
        parse_settings({key: 1 << 40}, None)


def test_staging_total_across_threads_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 send + 8 receive threads of 2 GiB each on a 24 GiB machine: each buffer fits, the 32
    GiB they make together does not."""
    monkeypatch.setattr(store_cfg, "machine_memory_bytes", lambda: 24 << 30)
    ok = {"staging_buffer_bytes": "2GiB", "send_threads": 4, "recv_threads": 4}
    assert parse_settings(ok, None).staging_buffer_bytes == 2 << 30
    with pytest.raises(ConfigError, match=r"staging_buffer_bytes x \(send_threads \+ "
                                          r"recv_threads\) = 2147483648 x 16: .* more than"):
        parse_settings(dict(ok, send_threads=8, recv_threads=8), None)
    with pytest.raises(ConfigError) as e:  # one buffer too big: one problem, not two
        parse_settings({"staging_buffer_bytes": "32GiB"}, None)
    assert len(e.value.problems) == 1


@pytest.mark.parametrize("ns", ["a\nb", "tab\there", "nul\x00", "del\x7f", "ok\u2028"])
def test_namespace_with_control_characters_refused(ns: str) -> None:
    with pytest.raises(ConfigError, match="no control characters"):
        parse_settings({"namespace": ns}, None)


def test_namespace_printable_accepted() -> None:
    assert parse_settings({"namespace": "team-a/model v2"}, None).namespace == "team-a/model v2"


def _kv_cache_config() -> SimpleNamespace:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((3,), (5,)), dtypes=(torch.float32,) * 2,
                      mamba_cache_mode="align")
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=fa),
                                            SimpleNamespace(kv_cache_spec=mamba)])


@pytest.mark.parametrize("key", ["turn_end_checkpoints", "junction_checkpoints"])
def test_checkpoints_true_without_partial_hits_is_an_error(key: str) -> None:
    pytest.importorskip("vllm")
    from tailproof.impl.config import resolve_reuse_extension

    whole = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                          hash_block_size=16, scheduler_block_size=16, partial_hits=False,
                          use_eagle=False)
    sc = SimpleNamespace(speculative_config=None)
    on = parse_settings({key: True}, None)
    _, errors, _ = resolve_reuse_extension(on, whole, sc, _kv_cache_config())
    assert errors == [f"{key}=true needs partial hash hits (hash_block_size below the lcm of "
                      "the group block sizes; docs/reuse.md)"]
    fine = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                         hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                         use_eagle=False)
    assert resolve_reuse_extension(on, fine, sc, _kv_cache_config())[1] == []
    auto = parse_settings({key: "auto"}, None)  # auto: off, noted, never an error
    resolved, errors, notes = resolve_reuse_extension(auto, whole, sc, _kv_cache_config())
    assert errors == [] and not getattr(resolved, key) and notes
