"""Findings about the installed vLLM from its open upstream bugs: reported, never failures.

A trace detector reads one replayed case's observations (vLLM's, or the reference's where they
stand for the installed release) and reports where the bug shows; ``check`` and ``replay`` add
one finding per bug to the report's ``findings`` (``result: "counterexample"`` with the first
witness and a count, never a change of exit status). A static detector inspects the installed
vLLM itself (``check`` only); an engine detector runs its ``Scheduler`` (``engine.py``,
``tailproof history`` only). Each detector cites the vLLM rule it watches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tailproof.conformance.format.tokens import expand
from tailproof.conformance.harness.adapters import refusal
from tailproof.conformance.harness.releases import ReleaseGate, installed_release
from tailproof.conformance.tools.history.bugs import by_ref

Witness = tuple[int, str]  # (op index, message)
Obs = list[dict[str, Any] | None]

#: Adapters whose observations speak for the installed vLLM, most direct first.
VLLM_VOICES = ("vllm-mooncake", "vllm", "reference")


def decode_boundary_dropped(ops: list[dict[str, Any]], obs: Obs,
                            config: dict[str, Any]) -> list[Witness]:
    """vLLM #56972: with ``save_decode_cache`` on (decode blocks are saved for attention), a
    Mamba boundary state past the request's prompt that the core offers
    (``take_boundary_state_offloads``) and the connector step offers but does not put
    (``MooncakeStoreScheduler._handle_boundary_state_offloads`` drops boundaries past
    ``prefill_end_tokens``; a ``kv_consumer`` skips them all). Without ``save_decode_cache``
    no group saves decode blocks: dropping the Mamba state there is the configuration's."""
    if not (config.get("connector") or {}).get("save_decode_cache"):
        return []
    prompts: dict[str, list[int]] = {}
    out: list[Witness] = []
    for i, (op, o) in enumerate(zip(ops, obs, strict=True)):
        if op["op"] == "add_request":
            prompts[op["rid"]] = expand(op["tokens"], prompts)
        if op["op"] != "conn_step" or not o:
            continue
        put = {(j.get("rid"), p["group"], p["boundary"])
               for j in o.get("jobs") or [] for p in j.get("puts") or []}
        for off in o.get("offered") or []:
            rid, boundary = off["rid"], off["boundary"]
            if rid in prompts and boundary > len(prompts[rid]) and \
                    (rid, off["group"], boundary) not in put:
                out.append((i, f"{rid}'s Mamba state at {boundary} (prompt "
                               f"{len(prompts[rid])}) offered, no job puts it"))
    return out


#: Ops that leave the pool's keys as they are (between a snapshot and the lookup it vouches for).
_KEY_NEUTRAL = {"add_request", "new_step", "pool_state", "table", "conn_state", "store_keys"}


def _fa_prefix(keys: set[tuple[int, int]], group: int, block: int) -> int:
    """The longest run of ``group``'s full-block keys from 0 (an upper bound on any request's
    hit in that group: keys of other prefixes only lengthen it)."""
    b = 0
    while (group, b + block) in keys:
        b += block
    return b


def junction_past_a_group(ops: list[dict[str, Any]], obs: Obs,
                          config: dict[str, Any]) -> list[Witness]:
    """vLLM #56142: ``HybridKVCacheCoordinator.find_longest_cache_hit`` derives the shared-prefix
    boundary from ``longest_hit_length``, the longest single-group hit, so a lookup's junction
    can pass what another full-attention group holds. Read off a ``pool_state`` whose keys stand
    until the ``lookup`` (only key-neutral ops between): each FA group's run of keys bounds its
    hit from above, so a junction past the smallest bound is past that group's hit."""
    fa = [(g, d["block_size"]) for g, d in enumerate(config["groups"])
          if d["kind"] == "full_attention"]
    if len(fa) < 2:
        return []
    out: list[Witness] = []
    keys: set[tuple[int, int]] | None = None
    for i, (op, o) in enumerate(zip(ops, obs, strict=True)):
        if op["op"] == "pool_state" and o is not None:
            keys = {(k[0], k[1]) for k in o.get("keys", [])}
        elif op["op"] == "lookup" and o is not None and keys is not None:
            junction = o.get("junction") or 0
            bounds = {g: _fa_prefix(keys, g, b) for g, b in fa}
            g_min = min(bounds, key=lambda g: bounds[g])
            if junction > max(o.get("hit", 0), bounds[g_min]):
                out.append((i, f"{op['rid']}'s junction {junction} passes full-attention "
                               f"group {g_min}'s keys (at most {bounds[g_min]}; groups' runs "
                               f"{[bounds[g] for g, _ in fa]})"))
        elif op["op"] not in _KEY_NEUTRAL:
            keys = None
    return out


#: Trace detectors: finding id -> (bug ref, invariant name, detector).
Detector = Callable[[list[dict[str, Any]], Obs, list[dict[str, Any]]], list[Witness]]
TRACE_DETECTORS: dict[str, tuple[str, str, Detector]] = {
    "decode_boundary_dropped": ("vllm#56972", "decode_boundary_state_stored",
                                decode_boundary_dropped),
    "junction_past_a_group": ("vllm#56142", "junction_within_every_fa_hit",
                              junction_past_a_group),
}

#: Fields a store key must depend on for stored bytes to be interchangeable (vLLM #56971).
LAYOUT_FIELDS = ("dtype", "kv_cache_dtype", "cache_dtype", "quantization", "layout")


def keys_ignore_layout() -> list[Witness]:
    """vLLM #56971: ``PoolKey.build_prefix`` builds every key from ``KeyMetadata`` alone;
    a key ignores the layout when no field of it names a dtype, quantization or layout."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            KeyMetadata,
        )
    except ImportError:
        return []
    names = [f.name for f in dataclasses.fields(KeyMetadata)]
    if any(any(k in n for k in LAYOUT_FIELDS) for n in names):
        return []
    return [(-1, f"KeyMetadata fields {', '.join(names)}: none names a dtype, quantization "
                 "or layout")]


#: Static detectors: finding id -> (bug ref, invariant name, detector).
STATIC_DETECTORS: dict[str, tuple[str, str, Callable[[], list[Witness]]]] = {
    "keys_ignore_layout": ("vllm#56971", "store_key_covers_layout", keys_ignore_layout),
}


def _finding(fid: str, ref: str, invariant: str, witnesses: list[tuple[str, str, int, str]],
             ) -> dict[str, Any]:
    bug = by_ref(ref)
    trace, adapter, op_index, message = witnesses[0]
    where = f"{trace}[{op_index}] ({adapter}): " if trace else ""
    return {"name": f"{ref}: {fid}", "bug": ref, "source": "history",
            "result": "counterexample", "invariant": invariant,
            "message": f"{where}{message}" + (f" (+{len(witnesses) - 1} more)"
                                             if len(witnesses) > 1 else ""),
            "explanation": bug.statement, "trace": trace or None,
            "op_index": op_index if trace else None, "adapter": adapter or None,
            "witnesses": len(witnesses)}


def _ran(r: Any, adapter: str) -> bool:
    obs = r.observations.get(adapter)
    return bool(obs) and any(o is not None for o in obs)


def _other_release(r: Any) -> bool:
    """Whether the reference's observations of ``r`` are not the installed vLLM's: it follows
    the trace's release, and the installed one observes the trace differently
    (``ReleaseGate``; a vLLM-backed adapter refuses such a trace and leaves no voice)."""
    installed = installed_release()
    return (installed is not None and r.trace.config.vllm != installed
            and ReleaseGate(r.trace, installed).first_difference() is not None)


def trace_findings(results: Iterable[Any]) -> list[dict[str, Any]]:
    """One finding per open bug some replayed case exhibits (``CaseResult`` objects), as the
    installed vLLM observes it."""
    found: dict[str, list[tuple[str, str, int, str]]] = {}

    for r in results:
        voice = next((a for a in VLLM_VOICES if _ran(r, a)), None)
        # The reference models the TailproofConnector extension where a trace turns it on
        # (the vLLM adapters refuse such traces): it speaks for vLLM only elsewhere.
        if voice is None or refusal("vllm-mooncake", r.trace.config) is not None:
            continue
        ops = r.trace.raw.get("ops", [])
        for fid, (_ref, _inv, detect) in TRACE_DETECTORS.items():
            witnesses = detect(ops, r.observations[voice], r.trace.raw["config"])
            if witnesses and voice == "reference" and _other_release(r):
                continue
            for i, msg in witnesses:
                found.setdefault(fid, []).append((r.trace.name, voice, i, msg))
    return [_finding(fid, TRACE_DETECTORS[fid][0], TRACE_DETECTORS[fid][1], ws)
            for fid, ws in found.items()]


def static_findings() -> list[dict[str, Any]]:
    """The findings read off the installed vLLM itself (no trace)."""
    out = []
    for fid, (ref, inv, detect) in STATIC_DETECTORS.items():
        ws = detect()
        if ws:
            out.append(_finding(fid, ref, inv, [("", "", i, m) for i, m in ws]))
    return out


def _forced_preemption_stalls() -> list[Witness]:
    from tailproof.conformance.tools.history.engine import (  # deferred: runs vLLM
        forced_preemption_stalls,
    )

    return forced_preemption_stalls()


#: Engine detectors: finding id -> (bug ref, invariant name, detector).
ENGINE_DETECTORS: dict[str, tuple[str, str, Callable[[], list[Witness]]]] = {
    "forced_preemption_stalls": ("tailproof#forced-preemption", "readmitted_request_is_served",
                                 _forced_preemption_stalls),
}


def engine_finding(fid: str) -> dict[str, Any] | None:
    """Run one engine detector; its finding, None when the bug does not show."""
    ref, inv, detect = ENGINE_DETECTORS[fid]
    ws = detect()
    if not ws:
        return None
    return {**_finding(fid, ref, inv, [("", "", i, m) for i, m in ws]),
            "message": "; ".join(m for _, m in ws)}  # every variant: each is the finding


def print_findings(findings: list[dict[str, Any]], out: TextIO) -> None:
    """The history findings in text form (they never change the exit status)."""
    mine = [f for f in findings if f.get("source") == "history"]
    if not mine:
        return
    print(f"findings about vLLM {installed_release() or '(none installed)'} (open upstream "
          "bugs; not failures, exit status unchanged):", file=out)
    for f in mine:
        print(f"  {f['name']}: {f['message']}", file=out)
