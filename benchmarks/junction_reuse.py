"""Prefix reuse at a shared-prefix junction on vLLM 0.33's real ``Scheduler`` (device cache
only, no connector), with ``CacheConfig.enable_mamba_shared_prefix_checkpoint`` off and on.

Workload (agent / tool calls): 16 conversations share a system prompt of ``--system`` tokens
(4,000 by default: on the h grid, off the Mamba grid of 1,024); each runs ``--turns`` turns, a
turn's prompt being the previous prompt, the previous response (``--output`` tokens) and a tool
result of 100-400 tokens. All first turns arrive at once; each later turn arrives when the
previous one finishes. Mamba blocks are 1,024 tokens, full-attention blocks 1,024 or 16
(``--fa-block``), h = 16 (``prefix_match_unit``); the pool is large enough that nothing is
evicted.

Reported per variant: hit/oracle (local prefix-cache hit at admission over the longest prefix
shared with tokens already computed by any request, capped at prompt - 1, floored to h), the
prefill tokens computed and their ratio to the minimum (prompt tokens less the oracle), and
the engine steps. The figures are counts, deterministic for a seed. Variants: ``off``;
``flag`` (the flag alone: vLLM narrows it away without an EAGLE group); ``flag+eagle`` (the
Mamba group flagged as an EAGLE group without the block drop, as with hash lookahead, so the
flag takes effect). The model runner is played by hand (no forward): only scheduling
decisions are measured.

    .venv/bin/python benchmarks/junction_reuse.py [--system 4000] [--turns 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "impl"))

BLOCK, H, MAX_LEN = 1024, 16, 32768


class ReuseRatios:
    """hit/oracle and prefill over the minimum, from a result's ``hit``, ``oracle``, ``prefill``."""

    hit: int
    oracle: int
    prefill: int

    @property
    def ratio(self) -> float:
        return self.hit / self.oracle if self.oracle else 1.0

    @property
    def prefill_over_min(self) -> float:
        """Prefill tokens over the minimum (every prompt token the oracle could not reuse)."""
        minimum = self.prefill + self.hit - self.oracle
        return self.prefill / minimum if minimum else 1.0


@dataclass
class Result(ReuseRatios):
    variant: str
    hit: int
    oracle: int
    prefill: int
    steps: int


def make_scheduler(flag: bool, eagle: bool, num_blocks: int, max_batched: int,
                   fa_block: int) -> Any:
    """vLLM's ``Scheduler`` for the tiny hybrid stand-in model, FA ``fa_block`` + Mamba 1024,
    h 16."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from tailproof.conformance.tools.capture_engine import tiny_hybrid

    init_none_hash(sha256)
    tiny_hybrid.register()
    mc = ModelConfig(model=str(tiny_hybrid.MODEL_DIR), skip_tokenizer_init=True,
                     dtype="float32", max_model_len=MAX_LEN)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="align",
                     prefix_match_unit=H, enable_mamba_shared_prefix_checkpoint=flag)
    sc = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=16,
                         max_model_len=MAX_LEN, is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, cache_config=cc, device_config=DeviceConfig("cpu"),
                    scheduler_config=sc)
    vc.cache_config.num_gpu_blocks = num_blocks
    fa = FullAttentionSpec(block_size=fa_block, num_kv_heads=1, head_size=4, dtype=torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=((3,), (5,)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["fa.l0"], fa), KVCacheGroupSpec(["m.l0"], mamba, is_eagle_group=eagle)],
        hash_block_size=H, cache_hit_alignment_tokens=H)
    return Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BLOCK, hash_block_size=H,
                     log_stats=False)


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _count_step(so: Any, live: dict[str, tuple[int, Any]], admitted: set[str],
                seen: list[Any], computed: list[list[int]], total: Result) -> None:
    """One step's figures: each newly admitted request's hit against the oracle's best
    h-aligned common prefix with what was computed before the step, and prefill tokens."""
    for rid, n in so.num_scheduled_tokens.items():
        req = live[rid][1]
        if rid not in admitted:
            admitted.add(rid)
            hit = req.num_computed_tokens - n
            cap = (req.num_prompt_tokens - 1) // H * H
            best = max((lcp(req.prompt_token_ids, t) for t in computed), default=0)
            total.hit += hit
            total.oracle += min(cap, best // H * H)
            seen.append(req)
        if req.num_computed_tokens <= req.num_prompt_tokens:
            total.prefill += n


def _sampled(rids: list[str], live: dict[str, tuple[int, Any]]) -> list[list[int]]:
    """A deterministic token for each request whose scheduled chunk ends its sequence."""
    sampled = []
    for rid in rids:
        req = live[rid][1]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([3 + (len(req.all_token_ids) * 7) % 400] if done else [])
    return sampled


def run(variant: str, system: int, turns: int, output: int, seed: int,
        max_batched: int, fa_block: int) -> Result:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from tailproof.conformance.vllm_release import model_runner_output

    num_blocks = 4096 * (BLOCK // fa_block)
    sched = make_scheduler(variant != "off", variant == "flag+eagle", num_blocks, max_batched,
                           fa_block)
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(3, 500) for _ in range(system)]
    convs = 16
    tools = [[[rng.randrange(3, 500) for _ in range(rng.randrange(100, 401))]
              for _ in range(turns)] for _ in range(convs)]
    prompts = {c: sys_prompt + tools[c][0] for c in range(convs)}
    turn = dict.fromkeys(range(convs), 0)
    seen: list[Any] = []  # every request so far (their computed tokens feed the oracle)
    live: dict[str, tuple[int, Any]] = {}
    total = Result(variant, 0, 0, 0, 0)

    def add(c: int) -> None:
        sp = SamplingParams(max_tokens=output, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        req = Request(f"c{c}t{turn[c]}", prompts[c], sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(H, sha256))
        sched.add_request(req)
        live[req.request_id] = (c, req)

    for c in range(convs):
        add(c)
    admitted: set[str] = set()
    while sched.has_requests():
        # The oracle's view: what every request had computed before this step.
        computed = [r.all_token_ids[:r.num_computed_tokens] for r in seen]
        so = sched.schedule()
        if so.num_scheduled_tokens:
            total.steps += 1
        _count_step(so, live, admitted, seen, computed, total)
        rids = list(so.num_scheduled_tokens)
        mro = model_runner_output(rids, sampled_token_ids=_sampled(rids, live))
        for o in sched.update_from_output(so, mro).values():
            for x in o.outputs:
                if x.finish_reason is None:
                    continue
                c, req = live.pop(x.request_id)
                turn[c] += 1
                if turn[c] < turns:
                    prompts[c] = list(req.all_token_ids) + tools[c][turn[c]]
                    add(c)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=4000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--max-batched", type=int, default=8192)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--fa-block", type=int, nargs="+", default=[1024, 16],
                    help="full-attention block sizes to run (Mamba stays 1024)")
    args = ap.parse_args(argv)
    print(f"load {os.getloadavg()[0]:.2f} (1 min); system {args.system}, turns {args.turns}, "
          f"output {args.output}, Mamba block {BLOCK}, h {H}, "
          f"max_num_batched_tokens {args.max_batched}")
    print("fa    seed variant     hit/oracle  hit     oracle  prefill  prefill/min  steps")
    for fa_block in args.fa_block:
        for seed in range(args.seeds):
            for variant in ("off", "flag", "flag+eagle"):
                r = run(variant, args.system, args.turns, args.output, seed, args.max_batched,
                        fa_block)
                print(f"{fa_block:<5} {seed:<4} {variant:<10} {r.ratio:10.3f}  {r.hit:<7} "
                      f"{r.oracle:<7} {r.prefill:<8} {r.prefill_over_min:<12.3f} {r.steps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
