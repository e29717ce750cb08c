"""The connector warns when vLLM's prefix hashes cannot agree across processes (a random
``NONE_HASH`` seed: a non-cryptographic ``prefix_caching_hash_algo`` without
``PYTHONHASHSEED``), and stays quiet where they can (impl/hash_seed.py)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from tailproof.impl.hash_seed import random_seed_problem  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("algo", "seed", "agrees"), [
    ("sha256", None, True),  # vLLM's fixed default seed
    ("sha256_cbor", None, True),
    ("sha256", "7", True),
    ("xxhash", "7", True),  # the same PYTHONHASHSEED on every engine
    ("xxhash", None, False),  # os.urandom per process
    ("xxhash_cbor", None, False),
])
def test_rule_follows_vllms_resolve_none_hash_seed(algo: str, seed: str | None,
                                                   agrees: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule against vLLM's own: two fresh derivations of the seed are equal exactly when
    the connector finds no problem."""
    from types import SimpleNamespace

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    same = resolve_none_hash_seed(fn) == resolve_none_hash_seed(fn)
    env = {} if seed is None else {"PYTHONHASHSEED": seed}
    problem = random_seed_problem(SimpleNamespace(prefix_caching_hash_algo=algo), env)
    assert same == agrees
    assert (problem is None) == agrees
    if problem is not None:
        assert algo in problem and "PYTHONHASHSEED" in problem


@pytest.mark.parametrize("algo", ["xxhash", "sha256"])
def test_connector_warns_at_start(algo: str, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    from engine_sim import kv_cache_config, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tailproof.impl.connector import TailproofConnector

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vc = vllm_config({"store": "memory", "namespace": f"seed-{algo}"})
    vc.cache_config.prefix_caching_hash_algo = algo
    kvc = kv_cache_config(32, (("full_attention", 16), ("mamba", 16)), 4)
    with caplog.at_level(logging.WARNING, logger="tailproof.impl.connector"):
        conn = TailproofConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    warned = [r.getMessage() for r in caplog.records if "random hash seed" in r.getMessage()]
    assert (conn.hash_seed_problem is not None) == (algo == "xxhash")
    assert len(warned) == (1 if algo == "xxhash" else 0)
    conn.shutdown()
