"""StoreConfig validation, make_store, buffer conversion, and the missing-Mooncake messages."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tailproof.impl.stores import (
    MemoryStore,
    StoreConfig,
    StoreConfigError,
    StoreError,
    as_bytes_array,
    make_store,
    parse_size,
)
from tailproof.impl.stores import mooncake as mc_mod


def test_defaults_make_a_memory_store() -> None:
    with make_store({}) as s:
        assert isinstance(s, MemoryStore) and s.capacity_bytes == 1 << 30 and s.evict
    with make_store({"capacity_bytes": "2MB", "evict": False}) as s:
        assert isinstance(s, MemoryStore) and s.capacity_bytes == 2 << 20 and not s.evict


@pytest.mark.parametrize("text,value", [("64MB", 64 << 20), ("64 MiB", 64 << 20), ("1G", 1 << 30),
                                        ("512", 512), ("3kb", 3072), (7, 7)])
def test_parse_size(text: Any, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1MB", 1.5, True, -3, "1PB"])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_mooncake_config_parses() -> None:
    cfg = StoreConfig.from_dict({"backend": "mooncake", "master_address": "127.0.0.1:50051",
                                 "global_segment_size": "256MB", "protocol": "rdma",
                                 "rdma_devices": "mlx5_0", "rpc_timeout_ms": 2000})
    assert cfg.global_segment_size == 256 << 20 and cfg.protocol == "rdma"
    assert StoreConfig.from_dict({"backend": "mooncake", "master_address": "h:1",
                                  "global_segment_size": 0}).global_segment_size == 0


@pytest.mark.parametrize("raw,field", [
    ({"backend": "redis"}, "backend"),
    ({"capacity": 5}, "capacity"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": "big"}, "capacity_bytes"),
    ({"evict": "yes"}, "evict"),
    ({"backend": "mooncake"}, "master_address"),
    ({"backend": "mooncake", "master_address": "nohost"}, "master_address"),
    ({"backend": "mooncake", "master_address": "h:70000"}, "master_address"),
    ({"backend": "mooncake", "master_address": "h:1", "protocol": "udp"}, "protocol"),
    ({"backend": "mooncake", "master_address": "h:1", "global_segment_size": "8MB"},
     "global_segment_size"),
    ({"backend": "mooncake", "master_address": "h:1", "local_buffer_size": 10},
     "local_buffer_size"),
    ({"backend": "mooncake", "master_address": "h:1", "protocol": "rdma"}, "rdma_devices"),
    ({"backend": "mooncake", "master_address": "h:1", "rpc_timeout_ms": 5}, "rpc_timeout_ms"),
    ({"backend": "mooncake", "master_address": "h:1", "setup_retries": "1"}, "setup_retries"),
    ({"backend": "mooncake", "master_address": "h:1", "local_hostname": ""}, "local_hostname"),
    ({"copy_threads": 0}, "copy_threads"),
    ({"copy_threads": 9}, "copy_threads"),
    ({"backend": "mooncake", "master_address": "h:1", "copy_threads": "2"}, "copy_threads"),
])
def test_one_clear_error_per_bad_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(StoreConfigError) as ei:
        StoreConfig.from_dict(raw)
    assert len(ei.value.errors) == 1 and ei.value.errors[0].startswith(f"{field}: ")


def test_all_bad_fields_reported_together() -> None:
    with pytest.raises(StoreConfigError) as ei:
        StoreConfig.from_dict({"backend": "mooncake", "protocol": "udp", "foo": 1,
                               "global_segment_size": 5})
    fields = sorted(e.split(":")[0] for e in ei.value.errors)
    assert fields == ["foo", "global_segment_size", "master_address", "protocol"]
    assert isinstance(ei.value, ValueError)


def test_buffer_views_share_memory_and_count_bytes() -> None:
    t = torch.zeros(8, dtype=torch.float16)
    v = as_bytes_array(t, writable=True)
    assert v.nbytes == 16 and v.dtype == np.uint8
    v[:] = 0xFF
    assert bool(torch.isnan(t).all())  # same memory, no copy
    assert as_bytes_array(np.zeros((2, 3), np.float64)).nbytes == 48
    assert as_bytes_array(memoryview(b"abc")).tolist() == [97, 98, 99]
    assert as_bytes_array(bytearray(4), writable=True).nbytes == 4
    with pytest.raises(ValueError):
        as_bytes_array(b"ro", writable=True)
    with pytest.raises(TypeError):
        as_bytes_array(torch.zeros(4, 4)[:, 0])
    with pytest.raises(TypeError):
        as_bytes_array(memoryview(bytearray(8))[::2])


def test_missing_mooncake_package_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # -> ModuleNotFoundError
    reason = mc_mod.unavailable_reason()
    assert reason and "'mooncake' package is not installed" in reason and "\n" not in reason
    with pytest.raises(StoreError, match="not installed"):
        make_store({"backend": "mooncake", "master_address": "127.0.0.1:1"})


def test_missing_libibverbs_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    reason = mc_mod.unavailable_reason()
    assert reason and "libibverbs.so.1 is missing (apt-get install -y libibverbs1" in reason


def test_copy_threads_reach_the_memory_store() -> None:
    from tailproof.impl.stores import make_store

    with make_store({"copy_threads": 3}) as store:
        assert store.copies.threads == 3
    with make_store({}) as store:
        assert store.copies.threads == 2
