"""Scheduler-thread time per prefill step with N waiting L-token prompts, on the installed vLLM's
real ``Scheduler`` (0.33 or 0.34; no forward): ``TailproofConnector`` (producer, memory store)
against the same scheduler without a connector, with a no-op connector (vLLM's own connector
path, the peer), and against the connector with remembered lookups off (every ask probes every
candidate key, as vLLM 0.33's ``MooncakeStoreWorker.lookup`` does).

The step: a running request R (16,384-token prompt) prefills 2,048 tokens a step
(``long_prefill_token_threshold``), leaving 8 tokens of the 2,056-token budget; the head
waiting request is then asked about (local prefix cache, then the connector's
``get_num_new_matched_tokens``) and not admitted (its Mamba-aligned chunk is 0), so it is
asked again every step, as vLLM 0.33 and 0.34 do; N - 1 more requests wait behind it. The
waiting prompts share nothing with R or the store (a hit would admit the head with an
asynchronous load). Timed: R's full-chunk steps, ``schedule()`` + ``update_from_output()``; the
model runner output (R's worker reporting every store job done, with its saved offset: one rank
whose puts all succeed) is built untimed. Groups: full attention 16 + Mamba 64, h = 16
(partial hits on).

Each round builds fresh schedulers and runs R's prefill steps on each variant, in an order
that rotates per round; a round's ratio is its total step time over the no-connector one's.
Prints min and median of the paired ratios, the keys probed per step, the connector's own
cost per step (its median step minus the no-op peer's, in µs: a release whose step is cheaper
raises the ratio while this stays put), the vLLM release and the machine load (``run_info``:
one ``--json`` line on stdout, also written to ``--json FILE``).

    .venv/bin/python benchmarks/waiting_lookups.py [--rounds 5] [--lengths 1024 8192 32768]
        [--waiting 16 64] [--running 16384] [--json FILE]
    PYTHONPATH=$(scripts/vllm_env.sh 0.33) .venv/bin/python benchmarks/waiting_lookups.py

``--running`` sets R's prompt (16,384: 7 full-chunk steps, where each request's first ask
weighs on the per-step figure; 65,536: 31 steps, a long prefill's steady state).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "impl"))
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # no forward: positions unused

GROUPS = (("full_attention", 16), ("mamba", 64))
H, BUDGET, CHUNK = 16, 2056, 2048
RUNNING = 16384  # R's prompt by default (``--running``)
VARIANTS = ("none", "noop", "connector", "no-memo")


def noop_connector(real: Any) -> Any:
    """A scheduler-side connector that does nothing (no hit, empty metadata, no stats; vLLM's
    ``KVConnectorBase_V1`` defaults otherwise): the peer that isolates what vLLM's own
    connector path costs per step (block state, boundary hand-offs,
    ``_update_from_kv_xfer_finished``) from the connector's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class NoopConnector(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_ext: int) -> None:
            return None

        def build_connector_meta(self, so: Any) -> Any:
            return KVConnectorMetadata()

        def start_load_kv(self, *a: Any, **k: Any) -> None:
            return None

        def wait_for_layer_load(self, *a: Any) -> None:
            return None

        def save_kv_layer(self, *a: Any, **k: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

    noop = object.__new__(NoopConnector)
    noop.__dict__.update({k: v for k, v in vars(real).items() if k.startswith("_")})
    return noop


def build(variant: str, max_len: int, num_blocks: int) -> Any:
    """A real Scheduler: no connector, or TailproofConnector (memo on / off)."""
    from engine_sim import kv_cache_config, vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc = vllm_config({"store": "memory", "namespace": f"wl-{random.random()}"}, h=H,
                     block_size=16, max_batched=BUDGET, max_model_len=max_len)
    vc.scheduler_config.long_prefill_token_threshold = CHUNK
    if variant == "none":
        vc.kv_transfer_config = None
    vc.cache_config.num_gpu_blocks = num_blocks
    kvc = kv_cache_config(num_blocks, GROUPS, H)
    sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=64, hash_block_size=H,
                      log_stats=False)
    if variant == "no-memo":
        sched.connector.scheduler_side.lookup_client.remember = False
    if variant == "noop":  # vLLM's scheduler built with a connector, then handed a no-op one
        real = sched.connector
        real.shutdown()
        sched.connector = noop_connector(real)
    return sched


def request(rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    sp.update_from_generation_config({}, eos_token_id=2)
    return Request(rid, tokens, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(H, sha256))


def run(variant: str, length: int, waiting: int,
        running: int = RUNNING) -> tuple[float, int, int]:
    """Seconds of scheduler-thread time over R's prefill steps, steps, keys probed."""
    from vllm.v1.outputs import KVConnectorOutput

    from tailproof.conformance.vllm_release import model_runner_output
    from tailproof.impl.meta import TailproofWorkerMeta

    rnd = random.Random(length * 1000 + waiting)
    sched = build(variant, running + length + 64, running // 16 + 400)
    sched.add_request(request("R", [rnd.randrange(3, 30000) for _ in range(running)]))
    for i in range(waiting):
        w = request(f"w{i}", [rnd.randrange(3, 30000) for _ in range(length)])
        sched.add_request(w)
    side = sched.connector.scheduler_side if variant not in ("none", "noop") else None
    probed0 = side.lookup_client.keys_probed if side else 0
    total, steps = 0.0, 0
    offsets: dict[str, int] = {}  # the simulated rank's saved offset per request
    done: dict[int, int] = {}  # job -> that offset once the job ran
    gc.collect()
    gc.disable()
    try:
        while running - sched.requests["R"].num_computed_tokens > CHUNK:  # full chunks only
            t0 = time.perf_counter()
            so = sched.schedule()
            total += time.perf_counter() - t0
            rids = list(so.num_scheduled_tokens)
            kvo = None
            if side is not None:  # one rank whose puts all succeed: its offset is each end
                for job in so.kv_connector_metadata.stores:
                    if job.token_len_chunk:
                        offsets[job.req_id] = job.token_len_chunk
                    done[job.store_job_id] = offsets.get(job.req_id, 0)
                kvo = KVConnectorOutput(kv_connector_worker_meta=TailproofWorkerMeta(
                    completed_saves={j: 1 for j in side.held},
                    saved_offsets={j: done.pop(j) for j in side.held}))
            elif variant == "noop":  # a model runner with a connector always reports
                kvo = KVConnectorOutput()
            # schedule() already advanced num_computed_tokens: a finished prefill samples
            sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                       else [] for r in rids]
            mro = model_runner_output(rids, sampled_token_ids=sampled, kv_connector_output=kvo)
            t0 = time.perf_counter()
            sched.update_from_output(so, mro)
            total += time.perf_counter() - t0
            steps += 1
            assert set(rids) == {"R"}, (variant, steps, dict(so.num_scheduled_tokens))
    finally:
        gc.enable()
    probed = (side.lookup_client.keys_probed - probed0) if side else 0
    if side is not None:
        sched.connector.shutdown()
    return total, steps, probed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--waiting", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--running", type=int, default=RUNNING,
                    help="R's prompt length (full 2,048-token chunks are timed)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = ap.parse_args(argv)
    from run_info import RunInfo
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    info = RunInfo.start()
    points = []
    for length in args.lengths:
        for n in args.waiting:
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            probes: dict[str, int] = {}
            steps = 0
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
                for v in order:
                    t, steps, p = run(v, length, n, args.running)
                    if r:
                        times[v].append(t)
                        probes[v] = p
            base = times["none"]
            line = [f"L={length:>6} N={n:>3} steps={steps}",
                    f"none {1e3 * statistics.median(base) / steps:.3f} ms/step"]
            for v in ("noop", "connector", "no-memo"):
                ratios = [a / b for a, b in zip(times[v], base, strict=True)]
                line.append(f"{v} {1e3 * statistics.median(times[v]) / steps:.3f} ms/step "
                            f"x{min(ratios):.2f}/{statistics.median(ratios):.2f}"
                            + (f" (keys/step {probes[v] / steps:.0f})" if v != "noop" else ""))
            beyond = [a / b for a, b in zip(times["connector"], times["noop"], strict=True)]
            own = [(a - b) / steps for a, b in zip(times["connector"], times["noop"], strict=True)]
            line.append(f"connector / noop x{min(beyond):.2f}/{statistics.median(beyond):.2f}")
            line.append(f"connector - noop {1e6 * statistics.median(own):.0f} us/step")
            print(" | ".join(line), flush=True)
            point: dict[str, Any] = {"length": length, "waiting": n, "steps": steps,
                                     "keys_per_step": probes["connector"] / steps}
            for v in VARIANTS:
                point[f"{v}_us_per_step_median"] = round(
                    1e6 * statistics.median(times[v]) / steps, 1)
                if v != "none":
                    ratios = [a / b for a, b in zip(times[v], base, strict=True)]
                    point[f"{v}_over_none"] = [round(min(ratios), 3),
                                               round(statistics.median(ratios), 3)]
            point["connector_over_noop"] = [round(min(beyond), 3),
                                            round(statistics.median(beyond), 3)]
            point["connector_minus_noop_us_per_step_median"] = round(
                1e6 * statistics.median(own), 1)
            points.append(point)
    info.finish({"benchmark": "waiting_lookups", "rounds": args.rounds,
                 "running": args.running, "ratios": "[min, median] of paired rounds",
                 "points": points}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
