"""``divergent_local_hits`` under vLLM 0.33's real Scheduler on CPU (``engine_sim``).

Attention blocks of 4 under Mamba blocks of 16, h 4. A request whose prefix was loaded from the
store holds one Mamba state, at its load's end; a later request sharing only a shorter prefix
with it finds those attention blocks locally but no Mamba state below them. With the setting
off vLLM reconciles that local hit to 0 and the request loads its whole hit into fresh blocks;
with it on (``supports_divergent_local_hybrid_hits``) vLLM reports the attention hit, the
request shares those blocks and loads only the rest, the load restoring the Mamba state at its
hit. Every load is checked byte for byte over the request's whole prefix, shared blocks
included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

pytestmark = pytest.mark.vllm

GROUPS = (("full_attention", 4), ("mamba", 16))
S = list(range(10, 30))  # 20 shared tokens: 5 attention blocks, past the Mamba boundary 16
A0 = S + list(range(100, 117))  # 37 tokens: stored states at 16, 32 and the tail (36)
B0 = S + list(range(200, 217))


@pytest.fixture
def store_ns(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Settings with a key namespace private to this test."""
    yield {"store": "memory", "namespace": f"t-{request.node.name}"[:60].replace("@", "_"),
           "capacity_bytes": 1 << 26}


def _whole_prefix_errors(e: Engine, loads: list[Any]) -> list[str]:
    """Byte mismatches of each load's request over ``[0, hit)`` (local blocks included)."""
    runner = e.workers[0][1]
    return [err for job in loads
            for err in runner.check(job.req_id, e.sched.requests[job.req_id].all_token_ids,
                                    0, job.kvpool_cached_tokens, job.block_ids)]


@pytest.mark.parametrize("divergent", [False, True])
def test_divergent_hit_shares_attention_blocks(store_ns: dict, divergent: bool) -> None:
    """B shares S with A, whose Mamba state is at A's load end only: B loads [16, 36) over
    A's attention blocks with the setting on, [0, 36) into its own blocks with it off."""
    e1 = Engine(store_ns, groups=GROUPS, num_blocks=256)
    e1.add("a0", A0, max_tokens=1)
    e1.add("b0", B0, max_tokens=1)
    e1.run()
    e2 = Engine({**store_ns, "divergent_local_hits": divergent}, groups=GROUPS, num_blocks=256)
    assert e2.conn.supports_divergent_local_hybrid_hits is divergent
    e2.add("a", A0 + [1, 2, 3], max_tokens=1)  # loads [0, 36): one Mamba state, at 36
    e2.step()
    a_fa = list(e2.sched.kv_cache_manager.get_block_ids("a")[0])
    e2.run()
    e2.add("b", B0 + [4, 5, 6], max_tokens=2)
    checked: list[Any] = []
    orig = e2.ranks._check_load

    def check(sched: Any, runner: Any, job: Any, log: Any) -> None:
        orig(sched, runner, job, log)
        checked.append(job)
        log.byte_errors += _whole_prefix_errors(e2, [job])

    e2.ranks._check_load = check
    logs = e2.run()
    loads = [j for log in logs for j in log.loads]
    assert [(j.req_id, j.vllm_cached_tokens, j.kvpool_cached_tokens) for j in loads] == [
        ("b", 16 if divergent else 0, 36)]
    assert [j.req_id for j in checked] == ["b"]
    assert [x for log in e2.log for x in log.byte_errors] == []
    # B's attention blocks of [0, 16): A's (shared on the device) only with the setting on.
    assert (loads[0].block_ids[0][:4] == a_fa[:4]) is divergent
    assert not set(loads[0].block_ids[0][4:]) & set(a_fa)  # the loaded ones are B's own
    assert e2.conn.scheduler_side.held == {} and e2.refcounts() == {}
    e2.shutdown()
    e1.shutdown()


def test_divergent_hits_refuse_windows_and_speculation() -> None:
    """A lagging sliding window or EAGLE's dropped block would be left unrestored: refused,
    each problem naming the setting; a plain hybrid is accepted."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tailproof.impl.config import StoreGeometry, divergent_hits_limits

    geo = StoreGeometry(core_group_ids=(0, 1), block_sizes=(4, 16), is_mamba=(False, True),
                        hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                        use_eagle=False)
    plain = SimpleNamespace(speculative_config=None)
    assert divergent_hits_limits(geo, plain) == []
    windowed = replace(geo, window_group_ids=frozenset({0}))
    assert divergent_hits_limits(windowed, plain) == [
        "divergent_local_hits=true is not supported here: KV cache group(s) [0] use a "
        "sliding window"]
    probs = divergent_hits_limits(replace(geo, use_eagle=True), plain)
    assert probs == ["divergent_local_hits=true is not supported here: speculative decoding "
                     "is configured"]
    assert len(divergent_hits_limits(windowed, SimpleNamespace(speculative_config=object()))) == 2
