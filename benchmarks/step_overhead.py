"""Engine step with store jobs vs the same step with no connector, on vLLM 0.33's real Scheduler.

Two engines share one set of KV tensors sized like a ~7B hybrid (bf16): 4 attention layers
(8 KV heads x 128, 16-token kernel blocks inside 256-token blocks: 1 MiB per layer per block)
and 24 Mamba2 layers (ssm 128 x 64 x 128 + conv 3 x 10,240 per layer: 49.4 MiB per block of
1,024 tokens) -- 16 MiB of attention KV and 49 MiB of Mamba state per 1,024-token chunk.
Engine A has ``TailproofConnector`` (scheduler role + one worker, played by hand in the order of
vLLM's ``KVConnectorModelRunnerMixin``); engine B has no connector. Each round runs the same
fresh requests (2,000-token prompts, 2 output tokens, chunked at 1,024) to completion on A, then
on B (the order alternates per round). Per request A stores one 1,024-token chunk (16 MiB), the
Mamba state at its sub-block checkpoint (49 MiB) and the attention tail blocks (12 MiB).

The forward is simulated with real work, single-threaded torch (``torch.set_num_threads(1)``,
so on a 2-core machine the connector's threads have the other core): per step ``--matmuls``
fp32 matmuls of 1024 x 1024 x 1024 (2.1 GFLOP each), then the scheduled tokens' attention
slots and the current Mamba state block are written (as a forward writes its KV). A's step
time includes everything the connector adds to the step: scheduler-side work, metadata,
``start_load_kv`` / ``wait_for_save`` / results, and whatever its threads take from the step
(CPU, memory bandwidth). Background work left at the end of A's round is waited for untimed.

    .venv/bin/python benchmarks/step_overhead.py [--rounds 7] [--store memory|network]
        [--gbps 1.5] [--matmuls 4] [--requests 2]

``--store network`` wraps the memory store in a 1-2 GB/s link emulation: every write/read
batch also sleeps bytes / rate after (before) its copy, as a NIC transfer would take wall time
but no CPU. Prints the machine load (``os.getloadavg``) before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "impl"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tailproof.impl.stores import MemoryStore, Outcome, Store  # noqa: E402

MIB = 1 << 20
FA_LAYERS, MAMBA_LAYERS = 4, 24
FA_BLOCK, KERNEL_BLOCK, MAMBA_BLOCK, H = 256, 16, 1024, 256
KV_HEADS, HEAD_DIM = 8, 128
SSM_SHAPE, CONV_SHAPE = (128, 64, 128), (3, 8192 + 2 * 8 * 128)
PROMPT, OUTPUT, CHUNK = 2000, 2, 1024


class LinkStore(Store):
    """A store behind an emulated network link of ``gbps`` GB/s: the bytes are copied into the
    inner store (the one CPU pass a real client makes into its registered buffer), then the
    transfer's wall time passes without CPU (``time.sleep``)."""

    name = "link"

    def __init__(self, inner: Store, gbps: float) -> None:
        self.inner = inner
        self.rate = gbps * 1e9

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def put_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        outs = self.inner.put_batch(keys, buffers)
        time.sleep(sum(o.nbytes for o in outs) / self.rate)
        return outs

    def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        outs = self.inner.get_batch(keys, buffers)
        time.sleep(sum(o.nbytes for o in outs) / self.rate)
        return outs

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Any,
                    staging: Any = None) -> list[Outcome]:
        outs = self.inner.write_batch(keys, sizes, produce, staging)
        time.sleep(sum(o.nbytes for o in outs) / self.rate)
        return outs

    def read_batch(self, keys: Sequence[str], sizes: Sequence[int], consume: Any,
                   staging: Any = None) -> list[Outcome]:
        time.sleep(sum(sizes) / self.rate)
        return self.inner.read_batch(keys, sizes, consume, staging)

    def remove(self, keys: Sequence[str]) -> int:
        return self.inner.remove(keys)

    def remove_all(self) -> int:
        return self.inner.remove_all()

    def close(self) -> None:
        self.inner.close()


def layer_names() -> tuple[list[str], list[str]]:
    return ([f"fa.{i}" for i in range(FA_LAYERS)], [f"mamba.{i}" for i in range(MAMBA_LAYERS)])


def make_kv(num_blocks: int) -> dict[str, Any]:
    """The KV tensors in vLLM 0.33's registration layout (``allocate_kv_cache``): attention a
    4D ``[blocks * r, heads, 16, 2 * dim]`` view (K/V fused, r kernel blocks per block), Mamba
    an int8 ``[blocks, 1, 1, state bytes]`` page view."""
    fa, mamba = layer_names()
    kv: dict[str, Any] = {}
    ratio = FA_BLOCK // KERNEL_BLOCK
    for n in fa:
        kv[n] = torch.zeros(num_blocks * ratio, KV_HEADS, KERNEL_BLOCK, 2 * HEAD_DIM,
                            dtype=torch.bfloat16)
    state_bytes = 2 * (math.prod(CONV_SHAPE) + math.prod(SSM_SHAPE))  # bf16
    for n in mamba:
        kv[n] = torch.zeros(num_blocks, 1, 1, state_bytes, dtype=torch.int8)
    return kv


def kv_cache_config(num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    fa, mamba = layer_names()
    groups = [
        KVCacheGroupSpec(fa, FullAttentionSpec(block_size=FA_BLOCK, num_kv_heads=KV_HEADS,
                                               head_size=HEAD_DIM, dtype=torch.bfloat16)),
        KVCacheGroupSpec(mamba, MambaSpec(block_size=MAMBA_BLOCK, shapes=(CONV_SHAPE, SSM_SHAPE),
                                          dtypes=(torch.bfloat16, torch.bfloat16),
                                          mamba_cache_mode="align")),
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         hash_block_size=H, cache_hit_alignment_tokens=H)


def plant_store(extra: dict[str, Any], store: Store) -> str:
    """Make the connector's roles use ``store`` for this configuration (its shared-store table
    is keyed by the store config), so a wrapper store needs no connector option."""
    from tailproof.impl import connector
    from tailproof.impl.config import parse_settings

    key = json.dumps(parse_settings(extra, "kv_both").store_config, sort_keys=True)
    connector._SHARED[key] = [store, 1]
    return key


class BenchEngine:
    """vLLM's Scheduler + (optionally) one Tailproof worker connector over shared KV."""

    def __init__(self, kv: dict[str, Any], num_blocks: int, extra: dict[str, Any] | None,
                 matmuls: int, peer_store: Any = None) -> None:
        from engine_sim import vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tailproof.impl.connector import TailproofConnector

        init_none_hash(sha256)
        vc = vllm_config(extra or {"store": "memory"}, h=H, block_size=FA_BLOCK,
                         max_batched=CHUNK)
        if extra is None:
            vc.kv_transfer_config = None
        vc.cache_config.num_gpu_blocks = num_blocks
        kvc = kv_cache_config(num_blocks)
        self.kv = kv
        self.sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=MAMBA_BLOCK,
                               hash_block_size=H, log_stats=False)
        self.wc: Any = None
        self.peer: Any = None  # vLLM's own Mooncake worker threads instead of ours
        if extra is not None and peer_store is not None:
            from vllm_peer import VllmSenderPeer

            self.peer = VllmSenderPeer(kv, *layer_names(), kvc, num_blocks,
                                       FA_BLOCK // KERNEL_BLOCK, peer_store)
        elif extra is not None:
            self.wc = TailproofConnector(vc, KVConnectorRole.WORKER, kvc)
            self.wc.register_kv_caches(kv)
        n = 1024
        self.a = torch.randn(n, n)
        self.b = torch.randn(n, n)
        self.matmuls = matmuls
        self.step_times: list[float] = []
        self.parts: dict[str, float] = {}  # seconds per step phase, all rounds
        self.latencies: dict[str, list[float]] = {"job_latency_s": [], "load_latency_s": []}
        self._enqueued: dict[int, float] = {}  # store job id -> when wait_for_save queued it
        self.pin_release_s: list[float] = []  # enqueue -> its pins released (all engines alike)

    def _stats(self, wc: Any) -> Any:
        """The worker's stats, as vLLM would log them; latency samples kept for the report."""
        st = wc.get_kv_connector_stats()
        if st is not None:
            for k, v in self.latencies.items():
                v += st.data.get(k, [])
        return st

    def add(self, rid: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        self.sched.add_request(Request(rid, prompt, sampling_params=sp, pooling_params=None,
                                       block_hasher=get_request_block_hasher(H, sha256)))

    def forward(self, so: Any) -> None:
        """Real compute, then write the scheduled tokens' KV (attention slots, Mamba state)."""
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)
        fa, mamba = layer_names()
        ratio = FA_BLOCK // KERNEL_BLOCK
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens
            start = end - n
            fa_ids, m_ids = self.sched.kv_cache_manager.get_block_ids(rid)
            for idx in range(start // FA_BLOCK, (end - 1) // FA_BLOCK + 1):
                b = fa_ids[idx]
                for name in fa:
                    self.kv[name][b * ratio:(b + 1) * ratio].fill_(end % 251)
            mb = m_ids[(end - 1) // MAMBA_BLOCK]
            for name in mamba:
                self.kv[name][mb].fill_(end % 253 - 126)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        from tailproof.conformance.vllm_release import model_runner_output

        t0 = time.perf_counter()
        so = self.sched.schedule()
        t1 = time.perf_counter()
        for c in so.kv_cache_block_copies or ():  # the step's CoW copies (Mamba hand-offs)
            for name, t in self.kv.items():
                if name.startswith("mamba"):
                    t[c.dst_block_id].copy_(t[c.src_block_id])
        kvo = None
        if self.wc is not None:
            self.wc.bind_connector_metadata(so.kv_connector_metadata)
        t2 = time.perf_counter()
        self.forward(so)
        t3 = time.perf_counter()
        if self.wc is not None:
            wc = self.wc
            wc.start_load_kv(None)
            wc.wait_for_save()
            res = wc.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
                invalid_block_ids=wc.get_block_ids_with_load_errors(),
                kv_connector_stats=self._stats(wc),
                kv_connector_worker_meta=wc.build_connector_worker_meta())
            wc.clear_connector_metadata()
        elif self.peer is not None:  # MooncakeStoreWorker.wait_for_save + its worker meta
            from tailproof.impl.meta import TailproofWorkerMeta

            self.peer.wait_for_save(so.kv_connector_metadata)
            done = self.peer.completed_saves()
            kvo = KVConnectorOutput(kv_connector_worker_meta=TailproofWorkerMeta(
                completed_saves=done) if done else None)
        t4 = time.perf_counter()
        meta = so.kv_connector_metadata
        for job in getattr(meta, "stores", ()):
            self._enqueued[job.store_job_id] = t3
        done_ids = kvo.kv_connector_worker_meta.completed_saves if (
            kvo is not None and kvo.kv_connector_worker_meta is not None) else {}
        rids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in rids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        mro = model_runner_output(rids, sampled_token_ids=sampled, kv_connector_output=kvo)
        self.sched.update_from_output(so, mro)
        now = time.perf_counter()  # the jobs reported this step have their pins released now
        for jid in done_ids:
            if jid in self._enqueued:
                self.pin_release_s.append(now - self._enqueued.pop(jid))
        if rids:
            t5 = time.perf_counter()
            self.step_times.append(t5 - t0)
            for k, v in (("schedule", t1 - t0), ("copies", t2 - t1), ("forward", t3 - t2),
                         ("connector", t4 - t3), ("update", t5 - t4)):
                self.parts[k] = self.parts.get(k, 0.0) + v

    def run_round(self, prompts: list[list[int]], tag: str) -> float:
        """Seconds of step time to serve ``prompts`` (steps that scheduled work only)."""
        self.step_times = []
        for i, p in enumerate(prompts):
            self.add(f"{tag}-{i}", p)
        while self.sched.has_requests():
            self.step()
        total = sum(self.step_times)
        if self.wc is not None:  # let the background jobs finish and their pins go (untimed)
            self.wc.worker_side.wait_idle(120.0)
            while self.sched.connector.has_pending_push_work():
                self.step()
        if self.peer is not None:
            deadline = time.monotonic() + 120.0
            while not self.peer.idle() and time.monotonic() < deadline:
                time.sleep(0.005)
            while self.sched.connector.has_pending_push_work():
                self.step()
        return total


def torch_copy_seconds(nbytes: int, rounds: int = 7) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_rounds(args: argparse.Namespace, a: BenchEngine, b: BenchEngine,
               v: BenchEngine | None) -> tuple[list[float], list[float], list[float],
                                                 list[float], list[list[int]]]:
    """The paired rounds (round 0 warms up): A with the connector, B without, V (vLLM's
    sending thread) when given, in an order that rotates; per round its times and ratios."""
    import random

    ratios, ta, tb, vratios = [], [], [], []
    prompts: list[list[int]] = []
    for r in range(args.rounds + 1):
        rng = random.Random(r)
        prompts = [[rng.randrange(10, 500) for _ in range(PROMPT)] for _ in range(args.requests)]
        order = [(a, "a"), (b, "b")] if r % 2 == 0 else [(b, "b"), (a, "a")]
        if v is not None:  # rotate A, B, V so each runs first, second and third in turn
            order = [[(a, "a"), (b, "b"), (v, "v")][(i + r) % 3] for i in range(3)]
        got = {}
        for eng, name in order:
            got[name] = eng.run_round(prompts, f"r{r}{name}")
        if r == 0:
            continue  # warm-up (first-touch of the store's pages, imports)
        ta.append(got["a"])
        tb.append(got["b"])
        ratios.append(got["a"] / got["b"])
        extra_v = ""
        if v is not None:
            vratios.append(got["v"] / got["b"])
            extra_v = f"; vLLM's Mooncake worker {got['v'] * 1e3:.1f} ms, ratio {vratios[-1]:.3f}"
        print(f"round {r}: with connector {got['a'] * 1e3:.1f} ms, without "
              f"{got['b'] * 1e3:.1f} ms, ratio {ratios[-1]:.3f}{extra_v}")
    return ratios, ta, tb, vratios, prompts


def print_saves(args: argparse.Namespace, a: BenchEngine, b: BenchEngine, v: BenchEngine | None,
                fake: Any, ratios: list[float], ta: list[float], tb: list[float],
                vratios: list[float]) -> None:
    """The save side's figures: step times, phases, paired ratios, bytes, job latencies."""
    ws = a.wc.worker_side
    lat = a.latencies["job_latency_s"]
    m = ws.metrics.c
    print(f"store: {args.store}" + (f" ({args.gbps} GB/s link)" if args.store == "network"
                                   else ""))
    print(f"steps per round: {len(a.step_times)}; step time with connector min/median "
          f"{min(ta) * 1e3:.1f}/{statistics.median(ta) * 1e3:.1f} ms, without "
          f"{min(tb) * 1e3:.1f}/{statistics.median(tb) * 1e3:.1f} ms")
    for eng, name in ((a, "with"), (b, "without")):
        print(f"step phases {name} connector (s, all rounds incl. warm-up): " + ", ".join(
            f"{k} {v:.2f}" for k, v in eng.parts.items()))
    print(f"paired ratio (with / without): min {min(ratios):.3f}, median "
          f"{statistics.median(ratios):.3f}")
    if v is not None:
        print(f"paired ratio vLLM 0.33 MooncakeStoreConnector sending thread (V / without): min "
              f"{min(vratios):.3f}, median {statistics.median(vratios):.3f}; its store got "
              f"{fake.put_bytes / MIB:.0f} MiB; step phases: " + ", ".join(
                  f"{k} {x:.2f}" for k, x in v.parts.items()))
    print(f"put bytes {m.total('put_bytes') / MIB:.0f} MiB in {m.total('put_batches')} batches; "
          f"jobs skipped (queue full) {m.total('jobs_skipped_queue_full')}")
    if lat:
        per_job = m.total("put_bytes") / max(1, len(lat))
        for eng, name in ((a, "ours"), (v, "vLLM's Mooncake sending thread")):
            if eng is not None and eng.pin_release_s:
                pr = eng.pin_release_s
                print(f"enqueue -> pins released ({name}): {len(pr)} jobs, median "
                      f"{statistics.median(pr) * 1e3:.1f} ms, min {min(pr) * 1e3:.1f} ms")
        print(f"store jobs: {len(lat)}, {per_job / MIB:.0f} MiB each on average; enqueue -> "
              f"reported (pins released at the next step) median "
              f"{statistics.median(lat) * 1e3:.1f} ms, min {min(lat) * 1e3:.1f} ms; torch copy "
              f"of the same bytes {torch_copy_seconds(int(per_job)) * 1e3:.1f} ms")


def run_loads(kv: Any, args: argparse.Namespace, extra: dict[str, Any],
              prompts: list[list[int]]) -> None:
    """Loads: a fresh engine (same store, same KV tensors) serves the last round's prompts
    again: every request loads its stored prefix while the others are computed."""
    c = BenchEngine(kv, args.num_blocks, extra, args.matmuls)
    cws = c.wc.worker_side
    c.run_round(prompts, "load")
    load_lat = c.latencies["load_latency_s"]
    got = cws.metrics.c.total("get_bytes")
    nloads = len(load_lat)
    copy_s = {n: torch_copy_seconds(n) for n in (16 * MIB, 77 * MIB)}
    print(f"torch copy of 16 MiB: {copy_s[16 * MIB] * 1e3:.1f} ms, of 77 MiB: "
          f"{copy_s[77 * MIB] * 1e3:.1f} ms")
    if nloads:
        per = got // nloads
        print(f"loads: {nloads}, {per / MIB:.0f} MiB each; start_load_kv -> finished "
              f"median {statistics.median(load_lat) * 1e3:.1f} ms; torch copy of the same "
              f"bytes {torch_copy_seconds(per) * 1e3:.1f} ms; failed "
              f"{cws.metrics.c.total('load_failures')}")
    c.wc.worker_side.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--store", choices=["memory", "network"], default="memory")
    ap.add_argument("--gbps", type=float, default=1.5)
    ap.add_argument("--matmuls", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=28)
    ap.add_argument("--vllm-peer", action="store_true",
                    help="also run vLLM 0.33's MooncakeStoreConnector sending thread (engine V) "
                         "on the same jobs, interleaved with A and B")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load before: {os.getloadavg()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}")
    kv = make_kv(args.num_blocks)
    extra = {"store": "memory", "namespace": f"bench-{os.getpid()}",
             "capacity_bytes": "512MB"}
    inner = MemoryStore(512 << 20)  # small enough that evicted values are recycled (steady state)
    store: Store = inner if args.store == "memory" else LinkStore(inner, args.gbps)
    plant_store(extra, store)
    a = BenchEngine(kv, args.num_blocks, extra, args.matmuls)
    b = BenchEngine(kv, args.num_blocks, None, args.matmuls)
    v = None
    if args.vllm_peer:
        from vllm_peer import FakeMooncakeStore

        fake = FakeMooncakeStore(512 << 20, args.gbps if args.store == "network" else None)
        v = BenchEngine(kv, args.num_blocks, {**extra, "namespace": extra["namespace"] + "-v"},
                        args.matmuls, peer_store=fake)
    ratios, ta, tb, vratios, prompts = run_rounds(args, a, b, v)
    ws = a.wc.worker_side
    print_saves(args, a, b, v, fake if v is not None else None, ratios, ta, tb, vratios)
    run_loads(kv, args, extra, prompts)
    print(f"load after: {os.getloadavg()}")
    ws.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
