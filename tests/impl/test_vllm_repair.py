"""Under vLLM 0.33's real ``Scheduler`` (``engine_sim``): a corrupt stored value fails the load
closed, is removed, and the recomputing request's own save rewrites it -- the next engine
loads the prefix again (write-once puts do not block the repair). Engines on different secrets
sharing the store never delete each other's values on a hit."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

from tailproof.impl.keys import parse_key  # noqa: E402
from tailproof.impl.value_format import HEADER_BYTES, SECRET_ENV  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))  # 45 tokens: blocks + a sub-block tail at 44


def _engine(ns: str) -> Engine:
    return Engine({"store": "memory", "namespace": ns, "capacity_bytes": 1 << 26})


def _values(e: Engine) -> dict[str, bytes]:
    """This engine's stored values (its namespace and MAC identity), by key."""
    store = e.workers[0][0].worker_side.store
    mine = e.workers[0][0].worker_side.keys
    return {k: bytes(v) for k, v in store._data.items()
            if k.startswith(f"kv2:{mine.namespace}@")
            and parse_key(k).mac_identity == mine.mac_identity}


def test_a_corrupt_value_is_removed_and_rewritten_by_the_recompute() -> None:
    e1 = _engine("repair")
    e1.add("p", A, max_tokens=1)
    e1.run()
    stored = _values(e1)
    store = e1.workers[0][0].worker_side.store
    attention = [k for k in stored if parse_key(k).group == 0]  # every load reads them all
    for k in attention:
        store._data[k][HEADER_BYTES + 3] ^= 1  # a bit flip in the pool

    e2 = _engine("repair")
    e2.add("c", list(A), max_tokens=1)
    logs = e2.run()
    w2 = e2.workers[0][0].worker_side
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    assert w2.metrics.c.total("load_failures") == 1  # never served: recomputed
    assert w2.metrics.c.total("verify_fail_checksum") == len(attention) > 0
    assert w2.metrics.c.total("verify_removed") == len(attention)
    assert _values(e2) == stored  # the recompute's save rewrote the value, byte for byte

    e3 = _engine("repair")
    e3.add("d", list(A), max_tokens=1)
    logs = e3.run()
    assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
    assert e3.workers[0][0].worker_side.metrics.c.total("load_failures") == 0
    assert [x for log in logs for x in log.byte_errors] == []
    for e in (e1, e2, e3):  # the last engine's shutdown closes the shared store
        e.shutdown()


def test_engines_on_two_secrets_share_a_store_without_deleting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported case: engines on different secrets take turns on a shared prefix (each a
    fresh engine, so the hit comes from the store, not the local prefix cache): every load is
    served from the engine's own identity's values, and nothing is ever removed."""
    warm = []
    for secret in ("a" * 32, "b" * 32):
        monkeypatch.setenv(SECRET_ENV, secret)
        e = _engine("two-secrets")
        e.add(f"warm-{secret[0]}", A, max_tokens=1)
        e.run()
        warm.append(e)
    before = (_values(warm[0]), _values(warm[1]))
    assert before[0] and before[1] and not before[0].keys() & before[1].keys()
    turns = []
    for i in range(2):
        for secret in ("a" * 32, "b" * 32):
            monkeypatch.setenv(SECRET_ENV, secret)
            e = _engine("two-secrets")
            e.add(f"hit-{i}", [*A, 7], max_tokens=1)
            logs = e.run()
            assert [j.kvpool_cached_tokens for log in logs for j in log.loads] == [44]
            assert [x for log in logs for x in log.byte_errors] == []
            m = e.workers[0][0].worker_side.metrics.c
            assert m.total("load_failures") == 0 and m.total("verify_removed") == 0
            turns.append(e)
    assert (_values(warm[0]), _values(warm[1])) == before
    for e in [*turns, *warm]:
        e.shutdown()
