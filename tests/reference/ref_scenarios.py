"""Ten hand-written scenarios, C1..C10, as traces with the exact block ids vLLM 0.33 allocates
as expectations (subset match on each op's observation): the producer's sub-block tail and
its running CoW (C1), a consumer hitting the CoW target (C2), same-step deferral (C3), finish
at and past the boundary (C4), equal block sizes (C5), a sub-block prompt (C6), EAGLE (C7), a
block-aligned prompt in one chunk (C8), eviction of the unpinned CoW target (C9) and a reset
blocked by a held CoW endpoint (C10). ``core_c01``..``core_c13`` of the corpus script the same
scenarios further."""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.trace import FORMAT_TAG
from tailproof.conformance.harness.steps import Op, Steps

FA2_M4_H2 = {
    "groups": [
        {"kind": "full_attention", "block_size": 2},
        {"kind": "mamba_align", "block_size": 4},
    ],
    "hash_block_size": 2,
}
PRODUCER = [0, 0, 1, 1, 2, 2, 9]  # P = 7, ck(P) = 6
# Which expected fields ``chunk`` pins on which op of the step.
CHUNK_EXPECT = {"allocate": ("new",), "drain_copies": ("copies", "retained"),
                "drain_offloads": ("offloads",)}


def trace(name: str, config: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT_TAG, "name": name, "config": config, "ops": ops}


def chunk(rid: str, expect: dict[str, Any] | None = None, *,
          first: bool = False) -> list[dict[str, Any]]:
    """One scheduler step for ``rid`` (``tailproof.conformance.harness.steps``): plan, allocate,
    drain (hand-offs, copies; the retention is kept), commit; ``expect`` pins the allocated
    blocks, the copies and retention, and the hand-offs."""
    ops: list[Op] = []

    def emit(trace_op: Op) -> None:
        pinned = {k: expect[k] for k in CHUNK_EXPECT.get(trace_op["op"], ()) if k in expect} \
            if expect else {}
        if pinned and trace_op["op"] == "allocate":
            pinned = {"ok": True, **pinned}
        ops.append({**trace_op, "expect": pinned} if pinned else trace_op)

    steps = Steps(emit)
    steps.begin()
    if first:
        steps.admit(rid)
    else:
        steps.run(rid)
    steps.drain(release=False)
    steps.commit(rid)
    return ops


def off(rid: str, group: int, block: int, boundary: int, kind: str) -> dict[str, Any]:
    return {"rid": rid, "group": group, "block": block, "boundary": boundary, "kind": kind}


def producer_c1() -> list[dict[str, Any]]:
    return [
        {"op": "add_request", "rid": "p", "tokens": PRODUCER},
        *chunk("p", {"new": [[1, 2], [3]], "offloads": [off("p", 1, 3, 4, "aligned")]},
               first=True),
        *chunk("p", {"new": [[4], [5]], "copies": [], "offloads": []}),
        *chunk("p", {"new": [[6], []], "copies": [[5, 7]], "retained": [5, 7],
                     "offloads": [off("p", 1, 7, 6, "tail")]}),
    ]


def c1() -> dict[str, Any]:
    """Producer P=7 chunks 4,6,7 (running CoW), decode boundary, free order."""
    ops = producer_c1() + [
        {"op": "table", "rid": "p", "expect": {"blocks": [[1, 2, 4, 6], [0, 5]]}},
        {"op": "pool_state", "expect": {"refcounts": [[1, 1], [2, 1], [4, 1], [5, 2], [6, 1],
                                                    [7, 1]]}},
        {"op": "release_retained"},
        {"op": "finalize_tail", "rid": "p", "expect": {"tails": []}},
        {"op": "append_output", "rid": "p", "tokens": [5]},
        {"op": "new_step"},
        {"op": "allocate", "rid": "p", "n": 1},
        {"op": "drain_offloads", "expect": {"offloads": [off("p", 1, 5, 8, "aligned")]}},
        {"op": "commit", "rid": "p"},
        {"op": "free", "rid": "p"},
        {"op": "pool_state", "expect": {
            "free_queue": [*range(8, 20), 3, 7, 6, 4, 2, 1, 5], "refcounts": []}},
    ]
    return trace("C1", {**FA2_M4_H2, "num_blocks": 20}, ops)


def c2() -> dict[str, Any]:
    """Consumer of C1's tail: hit 6 on the CoW target, first-allocation CoW, chunks 8 and 9."""
    ops = [op for op in c1()["ops"]] + [
        {"op": "add_request", "rid": "c", "tokens": [0, 0, 1, 1, 2, 2, 9, 9, 8]},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 6, "blocks": [[1, 2, 4], [0, 7]]}},
        {"op": "plan_chunk", "rid": "c", "use_hit": True, "expect": {"chunk": 2}},
        {"op": "allocate", "rid": "c", "n": "plan", "use_hit": True,
         "expect": {"ok": True, "new": [[8], [9]]}},
        {"op": "drain_copies", "expect": {"copies": [[7, 9]]}},
        {"op": "drain_offloads", "expect": {"offloads": [off("c", 1, 9, 8, "aligned")]}},
        {"op": "table", "rid": "c", "expect": {"blocks": [[1, 2, 4, 8], [0, 9]]}},
        {"op": "pool_state", "expect": {"refcounts": [[1, 1], [2, 1], [4, 1], [7, 1], [8, 1],
                                                    [9, 2]]}},
        {"op": "release_retained"},
        {"op": "commit", "rid": "c"},
        *chunk("c", {"new": [[10], [11]], "copies": [], "offloads": []}),
    ]
    return trace("C2", {**FA2_M4_H2, "num_blocks": 20}, ops)


def c3() -> dict[str, Any]:
    """Same step as the producer's running CoW, a consumer's hit on the moved key is deferred."""
    ops = producer_c1()[:-1]  # leave the last commit out: still the same step
    ops += [
        {"op": "add_request", "rid": "c", "tokens": [0, 0, 1, 1, 2, 2, 3, 3]},
        {"op": "lookup", "rid": "c", "expect": {"hit": 6}},
        {"op": "plan_chunk", "rid": "c", "use_hit": True},
        {"op": "allocate", "rid": "c", "n": "plan", "use_hit": True,
         "expect": {"ok": False, "new": None}},
        {"op": "release_retained"},
        {"op": "commit", "rid": "p"},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 6}},
        {"op": "plan_chunk", "rid": "c", "use_hit": True},
        {"op": "allocate", "rid": "c", "n": "plan", "use_hit": True, "expect": {"ok": True}},
    ]
    return trace("C3", {**FA2_M4_H2, "num_blocks": 24}, ops)


def _producer_to_6(extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"op": "add_request", "rid": "p", "tokens": PRODUCER},
        *chunk("p", first=True),
        *chunk("p", {"new": [[4], [5]]}),
        *extra,
    ]


def c4() -> dict[str, Any]:
    """Finish at the boundary: finalize hands off the table source once; past it or with
    tokens in flight, nothing."""
    at_boundary = trace("C4a", {**FA2_M4_H2, "num_blocks": 24}, _producer_to_6([
        {"op": "finalize_tail", "rid": "p", "expect": {"tails": [
            {"group": 1, "boundary": 6, "block": 5}]}},
        {"op": "finalize_tail", "rid": "p", "expect": {"tails": []}},
        {"op": "free", "rid": "p"},
    ]))
    past = _producer_to_6([
        {"op": "commit", "rid": "p", "n": 1},
        {"op": "finalize_tail", "rid": "p", "expect": {"tails": []}},
    ])
    in_flight = _producer_to_6([
        {"op": "set_in_flight", "rid": "p", "n": 2},
        {"op": "finalize_tail", "rid": "p", "expect": {"tails": []}},
    ])
    return {"at_boundary": at_boundary,
            "past": trace("C4b", {**FA2_M4_H2, "num_blocks": 24}, past),
            "in_flight": trace("C4c", {**FA2_M4_H2, "num_blocks": 24}, in_flight)}


def c5() -> dict[str, Any]:
    """FA4/M4/h2: FA partial tail too; the consumer CoWs both groups."""
    cfg = {"groups": [{"kind": "full_attention", "block_size": 4},
                      {"kind": "mamba_align", "block_size": 4}],
           "hash_block_size": 2, "num_blocks": 24}
    ops = [
        {"op": "add_request", "rid": "p", "tokens": PRODUCER},
        *chunk("p", {"offloads": [off("p", 1, 2, 4, "aligned")]}, first=True),
        *chunk("p"),
        *chunk("p", {"copies": [[4, 5]], "offloads": [off("p", 1, 5, 6, "tail")]}),
        {"op": "release_retained"},
        {"op": "free", "rid": "p"},
        {"op": "add_request", "rid": "c", "tokens": [0, 0, 1, 1, 2, 2, 9, 9, 8]},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 6, "blocks": [[1, 3], [0, 5]]}},
        {"op": "allocate", "rid": "c", "n": 2, "use_hit": True, "expect": {"ok": True}},
        {"op": "drain_copies", "expect": {"copies": [[3, 4], [5, 6]]}},
        {"op": "drain_offloads", "expect": {"offloads": [off("c", 1, 6, 8, "aligned")]}},
    ]
    return trace("C5", cfg, ops)


def c6() -> dict[str, Any]:
    """h4, FA4, Mamba16: a sub-block prompt; resend and shorter prompts."""
    cfg = {"groups": [{"kind": "full_attention", "block_size": 4},
                      {"kind": "mamba_align", "block_size": 16}],
           "hash_block_size": 4, "num_blocks": 40}
    prompt = list(range(100, 113))  # P = 13, ck = 12
    ops = [
        {"op": "add_request", "rid": "p", "tokens": prompt},
        *chunk("p", {"new": [[1, 2, 3], [4]]}, first=True),
        *chunk("p", {"copies": [[4, 6]], "offloads": [off("p", 1, 6, 12, "tail")]}),
        {"op": "release_retained"},
        {"op": "free", "rid": "p"},
        {"op": "add_request", "rid": "c", "tokens": prompt + [7, 7, 7]},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 12, "blocks": [[1, 2, 3], [6]]}},
        {"op": "allocate", "rid": "c", "n": 4, "use_hit": True, "expect": {"ok": True}},
        {"op": "drain_copies", "expect": {"copies": [[6, 5]]}},
        {"op": "drain_offloads", "expect": {"offloads": [off("c", 1, 5, 16, "aligned")]}},
        {"op": "add_request", "rid": "resend", "tokens": prompt},
        {"op": "lookup", "rid": "resend", "expect": {"hit": 12}},
        {"op": "add_request", "rid": "p12", "tokens": prompt[:12]},
        {"op": "lookup", "rid": "p12", "expect": {"hit": 0}},
        {"op": "add_request", "rid": "p3", "tokens": prompt[:3], "expect": {"num_hashes": 0}},
        {"op": "lookup", "rid": "p3", "expect": {"hit": 0}},
    ]
    return trace("C6", cfg, ops)


def c7() -> dict[str, Any]:
    """h4, FA16, Mamba16, EAGLE, P=49: chunks 32,44,48,49 and their hand-offs."""
    cfg = {"groups": [{"kind": "full_attention", "block_size": 16},
                      {"kind": "mamba_align", "block_size": 16}],
           "hash_block_size": 4, "num_blocks": 40, "use_eagle": True}
    prompt = [t % 7 for t in range(49)]
    ops = [
        {"op": "add_request", "rid": "p", "tokens": prompt},
        *chunk("p", {"offloads": [off("p", 1, 3, 32, "aligned")]}, first=True),
        *chunk("p", {"offloads": []}),
        *chunk("p", {"offloads": [off("p", 1, 6, 44, "tail"), off("p", 1, 5, 48, "aligned")]}),
        *chunk("p", {"offloads": []}),
        {"op": "release_retained"},
        {"op": "add_request", "rid": "c", "tokens": prompt + [9] * 8},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 44, "blocks": [[1, 2, 4], [0, 0, 6]]}},
        {"op": "add_request", "rid": "resend", "tokens": prompt},
        {"op": "lookup", "rid": "resend", "expect": {"hit": 44}},
    ]
    # The planned chunk ends 32, 44, 48, 49 are pinned by the plan_chunk observations.
    plans = [op for op in ops if op["op"] == "plan_chunk"]
    for op, size in zip(plans, [32, 12, 4, 1], strict=True):
        op["expect"] = {"chunk": size}
    return trace("C7", cfg, ops)


def c8() -> dict[str, Any]:
    """Block-aligned prompt in one chunk (no split): no tail at 2, so a resend misses."""
    cfg = {"groups": [{"kind": "full_attention", "block_size": 4},
                      {"kind": "mamba_align", "block_size": 4}],
           "hash_block_size": 2, "num_blocks": 24}
    ops = [
        {"op": "add_request", "rid": "p", "tokens": [0, 0, 1, 1]},
        {"op": "new_step"},
        {"op": "allocate", "rid": "p", "n": 4},
        {"op": "drain_offloads", "expect": {"offloads": [off("p", 1, 2, 4, "aligned")]}},
        {"op": "commit", "rid": "p"},
        {"op": "add_request", "rid": "r", "tokens": [0, 0, 1, 1]},
        {"op": "new_step"},
        {"op": "lookup", "rid": "r", "expect": {"hit": 0}},
    ]
    return trace("C8", cfg, ops)


def c9() -> dict[str, Any]:
    """The unpinned running-CoW target is a cache-only block: a filler evicts it."""
    ops = producer_c1() + [
        {"op": "release_retained"},
        {"op": "free", "rid": "p"},
        {"op": "add_request", "rid": "filler", "tokens": list(range(50, 70))},
        {"op": "new_step"},
        {"op": "allocate", "rid": "filler", "n": 20, "expect": {"ok": True}},
        {"op": "commit", "rid": "filler"},
        {"op": "free", "rid": "filler"},
        {"op": "add_request", "rid": "c", "tokens": [0, 0, 1, 1, 2, 2, 9, 9, 8]},
        {"op": "new_step"},
        {"op": "lookup", "rid": "c", "expect": {"hit": 0}},
    ]
    return trace("C9", {**FA2_M4_H2, "num_blocks": 12}, ops)


def c10() -> dict[str, Any]:
    """A held CoW endpoint keeps its block out of the free queue and blocks a reset."""
    ops = producer_c1() + [
        {"op": "free", "rid": "p"},
        {"op": "pool_state", "expect": {"refcounts": [[5, 1], [7, 1]]}},
        {"op": "reset", "expect": {"ok": False}},
        {"op": "release_retained"},
        {"op": "reset", "expect": {"ok": True}},
        {"op": "pool_state", "expect": {"keys": []}},
    ]
    return trace("C10", {**FA2_M4_H2, "num_blocks": 20}, ops)


def all_scenarios() -> dict[str, dict[str, Any]]:
    c4s = c4()
    return {"C1": c1(), "C2": c2(), "C3": c3(), "C4a": c4s["at_boundary"],
            "C4b": c4s["past"], "C4c": c4s["in_flight"], "C5": c5(), "C6": c6(), "C7": c7(),
            "C8": c8(), "C9": c9(), "C10": c10()}
