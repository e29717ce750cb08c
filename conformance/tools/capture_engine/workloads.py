"""Named workloads for ``tailproof capture``: realistic request patterns driven through vLLM
0.33's real Scheduler on CPU (``CaptureEngine``) and recorded by the live-engine recorder.

Each workload submits requests, aborts, resets and steps the engine the way a serving front
end would; everything the KV cache does in response is vLLM's own. The random choices come
from ``--seed`` only, so a capture is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tailproof.conformance.tools.capture_engine.engine import CaptureEngine

VOCAB = (3, 900)  # prompt token ids; sampled tokens are 1000.. (engine.next_token)


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    run: Callable[[CaptureEngine, random.Random], None]
    engine: dict[str, Any] = field(default_factory=dict)
    # Connector workloads: worker ranks they need (None: runs with or without a connector),
    # and the store's scripted put outcomes per rank (``seed, rank -> plan``).
    num_workers: int | None = None
    store_plan: Callable[[int, int], Callable[[], str]] | None = None


def _drain(e: CaptureEngine, steps: int | None = None) -> None:
    if steps is None:
        e.run()
        return
    for _ in range(steps):
        if not e.sched.has_requests():
            return
        e.step()


def chat(e: CaptureEngine, rng: random.Random) -> None:
    """Several conversations, interleaved: each turn resends the whole history (previous
    prompt + the model's answer) plus a new user message, so every turn hits the prefix
    cache at the last hash boundary of the history (a sub-block Mamba tail when h < block)."""
    convs = {f"c{i}": _text(rng, rng.randrange(20, 70)) for i in range(4)}
    for turn in range(5):
        live = []
        for cid, history in convs.items():
            rid = f"{cid}t{turn}"
            e.add(rid, history, max_tokens=rng.randrange(2, 9))
            live.append((cid, rid))
            _drain(e, rng.randrange(0, 3))
        _drain(e)
        for cid, rid in live:
            convs[cid] = convs[cid] + e.output_of(rid) + _text(rng, rng.randrange(5, 30))


def agent(e: CaptureEngine, rng: random.Random) -> None:
    """Agents sharing one long system prompt: each call is system prompt + task + the tool
    results so far; tool results come back between calls, several agents at a time."""
    system = _text(rng, 150)
    agents = {f"a{i}": system + _text(rng, rng.randrange(8, 40)) for i in range(5)}
    for call in range(6):
        for aid, ctx in agents.items():
            e.add(f"{aid}k{call}", ctx, max_tokens=rng.randrange(1, 6))
        _drain(e)
        for aid in agents:
            out = e.output_of(f"{aid}k{call}")
            agents[aid] = agents[aid] + out + _text(rng, rng.randrange(3, 25))  # tool result


def preemption(e: CaptureEngine, rng: random.Random) -> None:
    """More long requests than the block budget holds: the scheduler preempts the newest
    running request, which later re-prefills (hitting its own cached prefix)."""
    shared = _text(rng, 40)
    for i in range(6):
        prompt = (shared if i % 2 else []) + _text(rng, rng.randrange(60, 120))
        e.add(f"p{i}", prompt, max_tokens=rng.randrange(10, 30))
        _drain(e, rng.randrange(1, 4))
    _drain(e)


def aborts(e: CaptureEngine, rng: random.Random) -> None:
    """Requests aborted while waiting, mid-prefill and mid-decode; their cached prefixes
    serve the requests that follow."""
    base = _text(rng, 50)
    n = 0
    for _round in range(11):
        rids = []
        for _ in range(4):
            rid = f"q{n}"
            n += 1
            e.add(rid, base[: rng.randrange(20, 50)] + _text(rng, rng.randrange(10, 60)),
                  max_tokens=rng.randrange(3, 12))
            rids.append(rid)
        _drain(e, rng.randrange(0, 3))
        for rid in rng.sample(rids, 2):
            if rid in e.sched.requests:
                e.abort(rid)
        _drain(e, rng.randrange(1, 4))
        victim = next((r for r in rids if r in e.sched.requests), None)
        if victim is not None:
            e.abort(victim)
    _drain(e)


def max_tokens_1(e: CaptureEngine, rng: random.Random) -> None:
    """Prefill-only requests (``max_tokens=1``, e.g. scoring or a prefill node): each
    finishes right after its prefill, and later ones reuse the prefixes it cached."""
    docs = [_text(rng, rng.randrange(30, 90)) for _ in range(3)]
    for i in range(52):
        d = docs[i % 3]
        prompt = d[: rng.randrange(len(d) // 2, len(d) + 1)] + _text(rng, rng.randrange(0, 9))
        e.add(f"s{i}", prompt, max_tokens=1)
        _drain(e, rng.randrange(0, 2))
    _drain(e)


def resend(e: CaptureEngine, rng: random.Random) -> None:
    """Prompts served, then resent (prefix hits); the device prefix cache cleared
    (``reset_prefix_cache``: refused while blocks are in use, once forced by preempting every
    running request), then the same prompts resent again: they miss, recompute and are cached
    again."""
    prompts = [_text(rng, rng.randrange(30, 80)) for _ in range(4)]
    for rnd in range(4):
        for again in range(2):
            for i, p in enumerate(prompts):
                e.add(f"r{i}v{rnd}{again}", p, max_tokens=rng.randrange(2, 6))
            _drain(e, 2)
            if rnd == 2 and again:
                e.reset_prefix_cache()  # refused: blocks in use
                e.reset_prefix_cache(reset_running_requests=True)  # preempts, then clears
            _drain(e)
        e.reset_prefix_cache()


def _turns_with_resets(e: CaptureEngine, rng: random.Random, users: int, turns: int) -> None:
    """Users sharing a system prompt, turn after turn; the device prefix cache is cleared
    after every other turn, so the next turn's lookups are served by the connector's store."""
    system = _text(rng, 60)
    hist = {f"u{u}": system + _text(rng, rng.randrange(5, 30)) for u in range(users)}
    for turn in range(turns):
        for uid, ctx in hist.items():
            e.add(f"{uid}t{turn}", ctx, max_tokens=rng.randrange(2, 7))
            _drain(e, rng.randrange(0, 2))
        _drain(e)
        for uid in hist:
            hist[uid] = hist[uid] + e.output_of(f"{uid}t{turn}") + _text(rng, rng.randrange(4, 20))
        if turn % 2:
            assert e.reset_prefix_cache(), "reset_prefix_cache refused with the engine idle"


def store_failures(e: CaptureEngine, rng: random.Random) -> None:
    """Users sharing a system prompt over several turns, the device prefix cache cleared
    between turns, while the store refuses put batches (full, error, timeout) on a script:
    a refused key is absent, so later lookups stop at it and recompute (fail closed: a
    miss, never wrong bytes). Needs ``--connector tailproof``."""
    _turns_with_resets(e, rng, users=3, turns=6)


def two_workers(e: CaptureEngine, rng: random.Random) -> None:
    """The same turns on two worker ranks: every store job and load runs on both ranks,
    and a key counts as stored only when every rank stored it. Needs ``--connector
    tailproof``."""
    _turns_with_resets(e, rng, users=3, turns=6)


def _refusal_plan(seed: int, rank: int) -> Callable[[], str]:
    """One put batch in three refused: full, error or timeout, from ``seed`` and ``rank``."""
    r = random.Random(seed * 1009 + rank)
    return lambda: r.choice(["ok"] * 3 + ["full", "error", "timeout"])


def mixed(e: CaptureEngine, rng: random.Random) -> None:
    """A serving mix on one engine: chat conversations, then agents sharing a system
    prompt, then prefill-only requests, each finding the cache the previous ones left."""
    chat(e, rng)
    agent(e, rng)
    max_tokens_1(e, rng)


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("chat", chat.__doc__ or "", chat),
    Workload("agent", agent.__doc__ or "", agent),
    Workload("preemption", preemption.__doc__ or "", preemption,
             {"num_blocks": 40, "max_batched": 256}),
    Workload("aborts", aborts.__doc__ or "", aborts),
    Workload("max_tokens_1", max_tokens_1.__doc__ or "", max_tokens_1),
    Workload("resend", resend.__doc__ or "", resend),
    Workload("mixed", mixed.__doc__ or "", mixed),
    Workload("store_failures", store_failures.__doc__ or "", store_failures,
             num_workers=1, store_plan=_refusal_plan),
    Workload("two_workers", two_workers.__doc__ or "", two_workers, num_workers=2),
]}

# Block geometries the corpus captures each workload on: (groups, h).
GEOMETRIES: dict[str, tuple[tuple[tuple[str, int], ...], int]] = {
    "fa16-m16-h4": ((("full_attention", 16), ("mamba", 16)), 4),
    "fa8-m16-h4": ((("full_attention", 8), ("mamba", 16)), 4),
    "fa16-m32-h8": ((("full_attention", 16), ("mamba", 32)), 8),
    "fa16-m64-h16": ((("full_attention", 16), ("mamba", 64)), 16),
}
