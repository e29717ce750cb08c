"""TailproofConnector driven through Model Runner V2's own connector plumbing, on CPU.

vLLM 0.33 uses Model Runner V2 by default on a GPU (``VllmConfig.use_v2_model_runner``); it
needs Triton for its forward, but its connector wrapper (``v1/worker/gpu/kv_connector.py``:
``ActiveKVConnector``) and its KV allocation (``attn_utils.init_kv_cache`` ->
``allocate_kv_cache``, the same views the simulated runner registers) do not. These tests put
vLLM's real ``Scheduler`` and ``ActiveKVConnector`` around the connector: ``handle_preemptions``
and ``bind_connector_metadata`` before the forward, asynchronous loads started *after* it,
``finish_forward``, transfer results collected *before* ``wait_for_save`` when V2 defers it to
``finalize_step`` (a speculator runs). Every load is checked byte for byte; each runner must give
the same schedule, loads and outputs as Model Runner V1's order.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_sim import Engine  # noqa: E402

pytestmark = pytest.mark.vllm

A = list(range(10, 55))  # 45 tokens: a 44-token sub-block tail with h=4, block 16
B = A[:40] + list(range(300, 330))  # shares 40 tokens with A


HYBRID = (("full_attention", 16), ("mamba", 16))
FULL_ATTENTION = (("full_attention", 16),)  # synchronous loads need a single group


def _run(runner: str, ns: str, load_async: bool) -> dict[str, Any]:
    """Engine 1 serves A and B (B hits A's device blocks); engine 2, fresh, serves them again
    from the store (sub-block hits). Returns what each runner must agree on."""
    extra = {"store": "memory", "namespace": ns, "capacity_bytes": 1 << 26,
             "load_async": load_async}
    seen: dict[str, Any] = {"sched": [], "loads": [], "out": {}, "byte_errors": []}
    engines: list[Engine] = []  # the memory store lives while an engine on it does
    try:
        for n in (1, 2):
            e = Engine(extra, model_runner=runner, h=4 if load_async else 16,
                       groups=HYBRID if load_async else FULL_ATTENTION)
            engines.append(e)
            for rid, prompt in (("a", A), ("b", B)):
                req = e.add(f"{rid}{n}", list(prompt), max_tokens=20)  # decodes past a block
                logs = e.run(max_steps=200)
                seen["sched"].append([log.scheduled for log in logs])
                seen["loads"] += [(j.req_id, j.vllm_cached_tokens, j.kvpool_cached_tokens)
                                  for log in logs for j in log.loads]
                seen["byte_errors"] += [x for log in logs for x in log.byte_errors]
                seen["out"][f"{rid}{n}"] = list(req.output_token_ids)
            assert e.conn.scheduler_side.held == {}
            assert e.refcounts() == {}
    finally:
        for e in engines:
            e.shutdown()
    return seen


@pytest.mark.parametrize("load_async", [True, False], ids=["async-loads", "sync-loads"])
def test_v2_runner_matches_v1_byte_for_byte(load_async: bool,
                                            request: pytest.FixtureRequest) -> None:
    base = f"v2-{request.node.name}"[:50].replace("[", "-").replace("]", "")
    runs = {r: _run(r, f"{base}-{r}", load_async) for r in ("v1", "v2", "v2-deferred")}
    v1 = runs["v1"]
    assert v1["byte_errors"] == []
    # Engine 2 serves both prompts from the store (hybrid: the sub-block tail included).
    served = {rid: hit for rid, _, hit in v1["loads"]}
    assert served.get("a2") == (44 if load_async else 32) and served.get("b2", 0) >= 32
    for name in ("v2", "v2-deferred"):
        got = runs[name]
        assert got["byte_errors"] == [], name
        assert got["loads"] == v1["loads"], name
        assert got["out"] == v1["out"], name
        assert got["sched"] == v1["sched"], name


def test_unknown_model_runner_is_refused() -> None:
    with pytest.raises(ValueError, match="model_runner"):
        Engine({"store": "memory", "namespace": "v2-bad"}, model_runner="v3")
