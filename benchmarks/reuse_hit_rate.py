"""Prefix reuse on vLLM's real ``Scheduler`` (0.33 or 0.34) on CPU: device cache only vs
``TailproofConnector`` as vLLM does it (memory store), the baseline of the reuse work, vs vLLM's
own ``MooncakeStoreConnector`` with ``save_decode_cache`` (``mooncake``: on 0.34 it stores
decode-time Mamba states) vs ``TailproofConnector`` with the reuse extension
(``docs/reuse.md``: turn-end, decode-boundary and junction checkpoints on; on 0.34 the decode
boundaries are vLLM's own, ``save_decode_cache``).

Workloads (token streams fixed by the seed; "sampling" is ``engine_sim.Engine.next_token``, so
both variants see the same responses):

- ``chat-large``: 8 conversations x 4 turns; a turn's prompt is the previous prompt, the
  previous response (100-400 tokens) and a user message (first 300-1,500 tokens, then
  100-600); each next turn arrives when the previous one finishes; the device pool holds all.
- ``chat-small``: the same conversations with a device pool of ``--small-blocks`` blocks, so
  earlier turns are evicted and reuse has to come from the store.
- ``agent``: 16 conversations sharing a ``--system``-token system prompt (on the h grid, off
  the Mamba grid), 3 turns each: previous prompt, 64 output tokens, a 100-400-token tool
  result (the workload of ``junction_reuse.py``); large pool.
- ``resend``: 16 distinct prompts of 1,000-6,000 tokens run once; the device prefix cache is
  reset (``Scheduler.reset_prefix_cache``, store untouched) and the same prompts are resent.

Mamba and attention blocks are 1,024 tokens (vLLM gives a hybrid model one block size), h = 16
(``prefix_match_unit``), ``max_num_batched_tokens`` 8,192, 16 sequences at most.

Per workload and variant: hit/oracle, where hit is the prefix reused at a request's first
scheduled step (device plus store) and the oracle the longest prefix its prompt shares with
tokens an earlier request had computed before that step, capped at prompt - 1, floored to h;
prefill tokens over the minimum (prompt tokens less the oracle); engine steps (``schedule``
calls while requests remain); store bytes written (the workers' ``put_bytes``; none for
``mooncake``, whose store holds keys only); distinct store keys at the end; the extension's
extra device-to-device copy bytes per request (the workers' ``snapshot_copy_bytes``). The misses
(oracle - hit) are split by where they lie relative to the earlier request the oracle matched:
``junction`` (the shared prefix ends inside that request's prompt), ``preempted`` and ``prompt``
(below its prompt-tail checkpoint ck = floor_h(prompt - 1) although its whole prompt is
shared; ``preempted`` when that request was preempted, ``prompt`` otherwise),
``decode-block`` (from that checkpoint, or the hit if higher, up to the last Mamba block
boundary decoding crossed) and ``response`` (the rest: the last tokens of its prompt past ck
and its response). Preemptions are counted too. The figures are counts, deterministic for a
seed.

    .venv/bin/python benchmarks/reuse_hit_rate.py [--seeds 0 1] [--workloads chat-small ...]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "impl"))

import junction_reuse  # noqa: E402  (sets the vLLM environment defaults)
from junction_reuse import BLOCK, MAX_LEN, H, ReuseRatios, lcp  # noqa: E402

MISS_KINDS = ("junction", "preempted", "prompt", "decode-block", "response")
LARGE_BLOCKS = 1024


@dataclass
class Sizes:
    """Workload sizes (the smoke test shrinks them)."""

    chat_convs: int = 8
    chat_turns: int = 4
    chat_output: tuple[int, int] = (100, 400)  # response lengths, inclusive
    agent_convs: int = 16
    agent_turns: int = 3
    system: int = 4000
    agent_output: int = 64
    resend: int = 16
    resend_len: tuple[int, int] = (1000, 6000)  # prompt lengths, inclusive
    small_blocks: int = 24
    max_batched: int = 8192


@dataclass
class Result(ReuseRatios):
    """Counts of one workload under one variant."""

    workload: str
    variant: str
    hit: int = 0
    oracle: int = 0
    prefill: int = 0
    steps: int = 0
    put_bytes: int = 0
    copy_bytes: int = 0  # snapshot copies (reuse extension), all workers
    keys: int = 0  # distinct store keys at the end (every rank and group)
    requests: int = 0
    preempted: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_KINDS, 0))


@dataclass
class Turn:
    """One request to send: its prompt, output length, and what to append for the next turn."""

    conv: int
    prompt: list[int]
    output: int


# --------------------------------------------------------------------------- engines


class DeviceOnly:
    """vLLM's ``Scheduler`` with no connector (``junction_reuse.make_scheduler``), the model
    runner played by hand with ``Engine.next_token`` as the sampler."""

    def __init__(self, num_blocks: int, max_batched: int):
        from engine_sim import Engine

        self.sched = junction_reuse.make_scheduler(False, False, num_blocks, max_batched, BLOCK)
        self.next_token = Engine.next_token

    copy_bytes = 0  # no snapshot copies without a connector

    def stored_keys(self) -> int:
        """No store."""
        return 0

    def step(self) -> tuple[dict[str, int], list[str], int, int]:
        from tailproof.conformance.vllm_release import model_runner_output

        so = self.sched.schedule()
        reqs = self.sched.requests
        rids = list(so.num_scheduled_tokens)
        sampled = [[self.next_token(reqs[r])] if reqs[r].num_computed_tokens >= reqs[r].num_tokens
                   else [] for r in rids]
        mro = model_runner_output(rids, sampled_token_ids=sampled)
        outs = self.sched.update_from_output(so, mro)
        done = [x.request_id for o in outs.values() for x in o.outputs
                if x.finish_reason is not None]
        return dict(so.num_scheduled_tokens), done, 0, len(so.preempted_req_ids or ())

    def settle(self) -> int:
        """Nothing is in flight without a connector."""
        return 0

    def shutdown(self) -> None:
        """Nothing to release."""


class WithConnector:
    """``engine_sim.Engine``: vLLM's ``Scheduler`` building ``TailproofConnector`` (memory
    store) from its ``KVTransferConfig``, workers simulated with byte checks of every load."""

    def __init__(self, num_blocks: int, max_batched: int, namespace: str,
                 extra: dict[str, Any] | None = None):
        from engine_sim import Engine

        cfg = {"store": "memory", "namespace": namespace, **(extra or {})}
        self.copy_bytes = 0
        self.engine = Engine(cfg, num_blocks=num_blocks,
                             groups=(("full_attention", BLOCK), ("mamba", BLOCK)), h=H,
                             max_batched=max_batched, max_model_len=MAX_LEN)
        self.sched = self.engine.sched

    def step(self) -> tuple[dict[str, int], list[str], int, int]:
        log = self.engine.step()
        if log.byte_errors:
            raise RuntimeError(f"load byte mismatch: {log.byte_errors[0]}")
        self.copy_bytes += sum(s.get("snapshot_copy_bytes", 0) for s in log.worker_stats)
        return (log.scheduled, log.finished,
                sum(s.get("put_bytes", 0) for s in log.worker_stats), len(log.preempted))

    def settle(self) -> int:
        """Step until every store job reported; return the bytes those steps put."""
        put = 0
        while self.engine.conn.has_pending_push_work():
            put += self.step()[2]
        return put

    def stored_keys(self) -> int:
        """Distinct keys in the store (every rank's, every group's)."""
        return len(self.engine.conn.store.keys())

    def shutdown(self) -> None:
        self.engine.shutdown()


class VllmMooncake:
    """vLLM's own ``MooncakeStoreConnector`` with :data:`VLLM_PEER` (``save_decode_cache`` on:
    on vLLM 0.34 it stores decode-time Mamba states at block boundaries, #56972 fixed; 0.33
    drops them), its scheduler side built by vLLM's ``Scheduler`` from the
    ``KVTransferConfig`` exactly as :class:`WithConnector`'s; the worker rank is the capture
    engine's ``MooncakeRanks``: vLLM's own sending thread and lookup over an in-memory key
    store (keys only, no bytes, so no store MB; a load lands in the step that issued it, as
    the simulated workers' settled loads do)."""

    copy_bytes = 0  # no snapshot copies

    def __init__(self, num_blocks: int, max_batched: int):
        from engine_sim import Engine, kv_cache_config, vllm_config
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tailproof.conformance.tools.capture_engine.mooncake_ranks import MooncakeRanks

        init_none_hash(sha256)
        vc = vllm_config(VLLM_PEER, h=H, block_size=BLOCK, max_batched=max_batched,
                         max_model_len=MAX_LEN, connector="MooncakeStoreConnector")
        vc.cache_config.num_gpu_blocks = num_blocks
        kvc = kv_cache_config(num_blocks, (("full_attention", BLOCK), ("mamba", BLOCK)), H)
        self.sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BLOCK,
                               hash_block_size=H, log_stats=True)
        self.ranks = MooncakeRanks(self.sched, kvc, 1)
        self.next_token = Engine.next_token

    def step(self) -> tuple[dict[str, int], list[str], int, int]:
        so = self.sched.schedule()
        mro, _ = self.ranks.step(self.sched, so, self.next_token)
        outs = self.sched.update_from_output(so, mro)
        done = [x.request_id for o in outs.values() for x in o.outputs
                if x.finish_reason is not None]
        return dict(so.num_scheduled_tokens), done, 0, len(so.preempted_req_ids or ())

    def settle(self) -> int:
        """Step until every save reported (vLLM's connector pins blocks until then)."""
        while self.sched.connector.has_pending_push_work():
            self.step()
        return 0

    def stored_keys(self) -> int:
        return len(self.ranks.store.keys)

    def shutdown(self) -> None:
        self.ranks.shutdown()


# --------------------------------------------------------------------------- driver


class Driver:
    """Sends turns through an engine and accounts hits, the oracle and misses per admission."""

    def __init__(self, engine: Any, result: Result):
        self.engine = engine
        self.r = result
        self.seen: list[Any] = []  # admitted requests (their computed tokens feed the oracle)
        self.live: dict[str, tuple[Turn, Any]] = {}
        self.admitted: set[str] = set()
        self.n = 0

    def add(self, turn: Turn) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=turn.output, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        req = Request(f"r{self.n}c{turn.conv}", turn.prompt, sampling_params=sp,
                      pooling_params=None, block_hasher=get_request_block_hasher(H, sha256))
        self.n += 1
        self.engine.sched.add_request(req)
        self.live[req.request_id] = (turn, req)

    def _admit(self, req: Any, n: int, computed: list[int]) -> None:
        hit = req.num_computed_tokens - n
        cap = (req.num_prompt_tokens - 1) // H * H
        best, src = 0, None
        for other, count in zip(self.seen[:len(computed)], computed, strict=True):
            m = min(lcp(req.prompt_token_ids, other.all_token_ids), count)
            if m > best:
                best, src = m, other
        oracle = min(cap, best // H * H)
        self.r.hit += hit
        self.r.oracle += oracle
        self.r.requests += 1
        if oracle > hit and src is not None:
            self._classify(hit, oracle, best, src)
        self.seen.append(req)

    def _classify(self, hit: int, oracle: int, shared: int, src: Any) -> None:
        p = src.num_prompt_tokens
        if shared < p:
            self.r.misses["junction"] += oracle - hit
            return
        ck = (p - 1) // H * H  # where its prompt-tail checkpoint lies
        below = "preempted" if src.num_preemptions else "prompt"
        self.r.misses[below] += max(0, min(oracle, ck) - hit)
        lo = max(hit, ck)
        if oracle > lo:  # resumed at (or below) its checkpoint: its response is recomputed
            boundary = max(lo, oracle // BLOCK * BLOCK)  # last Mamba boundary decoding crossed
            self.r.misses["decode-block"] += boundary - lo
            self.r.misses["response"] += oracle - boundary

    def step(self, on_finish: Callable[[Turn, Any], None]) -> None:
        computed = [r.num_computed_tokens for r in self.seen]
        scheduled, finished, put, preempted = self.engine.step()
        self.r.steps += 1
        self.r.preempted += preempted
        self.r.put_bytes += put
        for rid, n in scheduled.items():
            turn, req = self.live[rid]
            if rid not in self.admitted:
                self.admitted.add(rid)
                self._admit(req, n, computed)
            if req.num_computed_tokens <= req.num_prompt_tokens:
                self.r.prefill += n
        for rid in finished:
            turn, req = self.live.pop(rid)
            on_finish(turn, req)

    def drain(self, on_finish: Callable[[Turn, Any], None]) -> None:
        while self.engine.sched.has_requests():
            self.step(on_finish)


# --------------------------------------------------------------------------- workloads


def tokens(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi + 1))]


def conversations(driver: Driver, first: list[list[int]], later: list[list[list[int]]],
                  outputs: list[list[int]]) -> None:
    """Each conversation's next turn (previous prompt + response + next message) is sent when
    its previous turn finishes."""

    def on_finish(turn: Turn, req: Any) -> None:
        c, k = turn.conv, next_turn[turn.conv]
        if k <= len(later[c]):
            next_turn[c] += 1
            driver.add(Turn(c, list(req.all_token_ids) + later[c][k - 1], outputs[c][k]))

    next_turn = dict.fromkeys(range(len(first)), 1)
    for c, prompt in enumerate(first):
        driver.add(Turn(c, prompt, outputs[c][0]))
    driver.drain(on_finish)


def chat(driver: Driver, rng: random.Random, sizes: Sizes) -> None:
    n, t = sizes.chat_convs, sizes.chat_turns
    first = [tokens(rng, 300, 1500) for _ in range(n)]
    later = [[tokens(rng, 100, 600) for _ in range(t - 1)] for _ in range(n)]
    lo, hi = sizes.chat_output
    outputs = [[rng.randrange(lo, hi + 1) for _ in range(t)] for _ in range(n)]
    conversations(driver, first, later, outputs)


def agent(driver: Driver, rng: random.Random, sizes: Sizes) -> None:
    n, t = sizes.agent_convs, sizes.agent_turns
    system = [rng.randrange(3, 500) for _ in range(sizes.system)]
    tools = [[tokens(rng, 100, 400) for _ in range(t)] for _ in range(n)]
    conversations(driver, [system + tools[c][0] for c in range(n)],
                  [tools[c][1:] for c in range(n)], [[sizes.agent_output] * t for _ in range(n)])


def resend(driver: Driver, rng: random.Random, sizes: Sizes) -> None:
    prompts = [tokens(rng, *sizes.resend_len) for _ in range(sizes.resend)]

    def ignore(turn: Turn, req: Any) -> None:
        """A resend is not a conversation: no next turn."""

    for c, p in enumerate(prompts):
        driver.add(Turn(c, p, 32))
    driver.drain(ignore)
    driver.r.put_bytes += driver.engine.settle()
    if not driver.engine.sched.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused (requests still running)")
    for c, p in enumerate(prompts):
        driver.add(Turn(c, list(p), 32))
    driver.drain(ignore)


WORKLOADS: dict[str, tuple[Callable[[Driver, random.Random, Sizes], None], bool]] = {
    # name: (builder, small device pool)
    "chat-large": (chat, False),
    "chat-small": (chat, True),
    "agent": (agent, False),
    "resend": (resend, False),
}
VARIANTS = ("device", "connector", "mooncake", "extension")
#: ``kv_connector_extra_config`` of the ``mooncake`` variant: vLLM's own connector as a user
#: deploys it for multi-turn reuse (asynchronous loads, its default; decode KV saved).
VLLM_PEER = {"load_async": True, "save_decode_cache": True}
#: ``kv_connector_extra_config`` of the ``extension`` variant (docs/reuse.md).
EXTENSION = {"turn_end_checkpoints": True, "decode_boundary_saves": True,
             "junction_checkpoints": True, "device_junctions": True}
PARTS = tuple(EXTENSION)  # what --only may pick


def run(workload: str, variant: str, seed: int, sizes: Sizes) -> Result:
    """One workload under one variant; the seed fixes every token and length."""
    build, small = WORKLOADS[workload]
    blocks = sizes.small_blocks if small else LARGE_BLOCKS
    ns = f"reuse-{workload}-{seed}"  # the memory store closes with its engine
    engine: Any
    if variant == "device":
        engine = DeviceOnly(blocks, sizes.max_batched)
    elif variant == "mooncake":
        engine = VllmMooncake(blocks, sizes.max_batched)
    else:
        engine = WithConnector(blocks, sizes.max_batched, ns,
                               EXTENSION if variant == "extension" else None)
    result = Result(workload, variant)
    driver = Driver(engine, result)
    try:
        build(driver, random.Random(f"{workload.split('-')[0]}:{seed}"), sizes)
        result.put_bytes += engine.settle()
        result.copy_bytes = engine.copy_bytes
        result.keys = engine.stored_keys()
    finally:
        engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--small-blocks", type=int, default=Sizes.small_blocks)
    ap.add_argument("--checkpoint-reserve", type=int, default=None,
                    help="checkpoint_reserve_blocks of the extension variant (default: the "
                         "connector's default)")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=None,
                    help="turn on only these parts in the extension variant (default: all)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args(argv)
    if args.only is not None:
        for part in PARTS:
            EXTENSION[part] = part in args.only
    if args.checkpoint_reserve is not None:
        EXTENSION["checkpoint_reserve_blocks"] = args.checkpoint_reserve
    sizes = Sizes(small_blocks=args.small_blocks)
    print(f"load {os.getloadavg()[0]:.2f} (1 min); seeds {args.seeds}; Mamba/FA block {BLOCK}, "
          f"h {H}, max_num_batched_tokens {sizes.max_batched}, device blocks {LARGE_BLOCKS} "
          f"(small {sizes.small_blocks}); extension {EXTENSION}")
    import vllm

    print(f"vLLM {vllm.__version__}; mooncake variant: vLLM's MooncakeStoreConnector {VLLM_PEER}")
    print("workload    seed variant    reqs hit/oracle  hit     oracle  prefill/min  steps  "
          "store MB  keys   preempt  misses " + "/".join(MISS_KINDS) + "  copy KB/req")
    for workload in args.workloads:
        for seed in args.seeds:
            for variant in args.variants:
                r = run(workload, variant, seed, sizes)
                miss = "/".join(str(r.misses[k]) for k in MISS_KINDS)
                print(f"{workload:<11} {seed:<4} {variant:<10} {r.requests:<4} {r.ratio:10.3f}  "
                      f"{r.hit:<7} {r.oracle:<7} {r.prefill_over_min:<12.3f} {r.steps:<6} "
                      f"{r.put_bytes / 1e6:<9.2f} {r.keys:<6} {r.preempted:<8} {miss}  "
                      f"{r.copy_bytes / 1e3 / max(1, r.requests):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
