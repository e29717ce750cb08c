"""Smoke test of ``benchmarks/reuse_hit_rate.py`` at a reduced size: the counts are sane and
deterministic, the store path beats the device cache where the device pool is small, and the
reuse extension (``docs/reuse.md``) is never worse than the connector without it, nor than
vLLM's own Mooncake store connector (``save_decode_cache`` on)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed in this environment")

SMALL = dict(chat_convs=3, chat_turns=2, chat_output=(20, 60), agent_convs=4, agent_turns=2,
             system=1200, agent_output=8, resend=3, resend_len=(1000, 2000),
             small_blocks=8)


def _run_isolated(pairs: list[tuple[str, str]] | None = None) -> dict[tuple[str, str], object]:
    """``reuse_hit_rate.run`` for each (workload, variant) at seed 0, in a fresh interpreter:
    the figures are a property of the token streams, so they must not depend on what earlier
    tests left in this process (its vLLM module state, stores, threads)."""
    import dataclasses
    import json
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import reuse_hit_rate as rh

    code = ("import json, sys; from dataclasses import asdict; "
            "from benchmarks import reuse_hit_rate as rh; a = json.loads(sys.argv[1]); "
            "s = rh.Sizes(**a['sizes']); "
            "print(json.dumps([asdict(rh.run(w, v, 0, s)) for w, v in a['pairs']]))")
    pairs = pairs or [(w, v) for w in rh.WORKLOADS for v in rh.VARIANTS]
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code, json.dumps({"sizes": SMALL, "pairs": pairs})],
                       capture_output=True, text=True, cwd=root, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    fields = {f.name for f in dataclasses.fields(rh.Result)}
    return {pair: rh.Result(**{k: v for k, v in row.items() if k in fields})
            for pair, row in zip(pairs, rows, strict=True)}


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], object]:
    return _run_isolated()


def test_counts_are_sane(results: dict) -> None:
    for (w, v), r in results.items():
        assert r.requests > 0 and r.steps > 0, (w, v)
        assert 0 <= r.hit <= r.oracle, (w, v, r.hit, r.oracle)
        assert 0.0 <= r.ratio <= 1.0, (w, v)
        assert r.prefill_over_min >= 1.0, (w, v)
        # Every missed token is attributed to exactly one kind.
        assert sum(r.misses.values()) == r.oracle - r.hit, (w, v, r.misses)
        # vLLM's own connector runs over a key store (no bytes); every connector stores keys
        assert (r.put_bytes > 0) == (v in ("connector", "extension")), (w, v, r.put_bytes)
        assert (r.keys > 0) == (v != "device"), (w, v, r.keys)
        assert (r.copy_bytes > 0) <= (v == "extension"), (w, v, r.copy_bytes)


def test_store_path_and_resend(results: dict) -> None:
    dev_small, conn_small = results["chat-small", "device"], results["chat-small", "connector"]
    assert conn_small.ratio >= dev_small.ratio
    assert dev_small.ratio < results["chat-large", "device"].ratio  # the small pool evicts
    # After a device cache reset only the store can serve the resent prompts.
    assert results["resend", "device"].hit == 0
    assert results["resend", "connector"].ratio > 0.9
    # Turns arrive after their predecessor finished: the oracle is then a property of the token
    # streams, not of the variant.
    for w in ("chat-large", "resend"):
        assert results[w, "device"].oracle == results[w, "connector"].oracle, w
        assert results[w, "extension"].oracle == results[w, "connector"].oracle, w


def test_extension_never_worse_than_connector(results: dict) -> None:
    """Turn-end checkpoints and decode boundary saves only add keys: never a lower hit/oracle
    or more prefill; on chat-large (next turns sent at finish, lookups wait for the flush)
    every response is reused."""
    from benchmarks import reuse_hit_rate as rh

    for w in rh.WORKLOADS:
        ext = results[w, "extension"]
        for peer in ("connector", "mooncake"):
            other = results[w, peer]
            assert ext.ratio >= other.ratio, (w, peer, ext.ratio, other.ratio)
            assert ext.prefill_over_min <= other.prefill_over_min, (w, peer)
    large = results["chat-large", "extension"]
    assert large.ratio == 1.0 and large.misses["response"] == 0
    assert results["chat-large", "connector"].misses["response"] > 0
    assert large.copy_bytes > 0


def test_deterministic(results: dict) -> None:
    again = _run_isolated([("resend", "connector")])
    assert again["resend", "connector"] == results["resend", "connector"]
