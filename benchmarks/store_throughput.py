"""Store save/load throughput for one 1024-token Mamba-aligned chunk of a ~7B hybrid model.

Prints a markdown table: bytes/s of each store operation and its ratio to a plain torch copy of
the same bytes measured in the same run, then the memory store's put and get against the torch
copy in interleaved rounds (copy, put, get, copy, put, get, ...): min and median of each and the
min / median of the paired per-round ratios (copy time / store time; goal >= 0.8), against
torch's default thread count and against one torch thread. ``--busy`` runs the paired part with
one busy core beside it (a spinning Python process, stopped by PID). The machine load
(``os.getloadavg``) is printed before and after.

    .venv/bin/python benchmarks/store_throughput.py [--rounds 20] [--no-mooncake] [--busy]

Geometry (a representative ~7B hybrid, Nemotron-H / Falcon-H1 class; bf16 everywhere):

* 24 Mamba2 layers, d_model 4096, expand 2 (d_inner 8192), head_dim 64 (128 heads),
  d_state 128, n_groups 8, d_conv 4.
  ssm state  = 128 heads * 64 * 128 * 2 B               = 2 MiB per layer
  conv state = (8192 + 2*8*128) * (4-1) * 2 B           = 60 KiB per layer
  One Mamba value per layer per chunk: 2,158,592 B.
* 4 attention layers, 8 KV heads, head_dim 128, 16-token blocks:
  2 (K,V) * 8 * 128 * 16 * 2 B = 64 KiB per block per layer; 1024 tokens = 64 blocks, gathered
  into one 4 MiB value per layer per chunk.
* One chunk = 24 + 4 = 28 values, 68,583,424 B (65.4 MiB), all views into one staging tensor
  (torch uint8, CPU), stored with one ``put_batch`` and loaded with one ``get_batch``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tailproof.impl.stores import MemoryStore, Store, make_store

KIB, MIB = 1 << 10, 1 << 20
MAMBA_LAYERS, ATTN_LAYERS = 24, 4
MAMBA_VALUE = 128 * 64 * 128 * 2 + (8192 + 2 * 8 * 128) * 3 * 2  # ssm + conv state, bf16
ATTN_BLOCK = 2 * 8 * 128 * 16 * 2  # K+V, 8 kv heads, head_dim 128, 16 tokens, bf16
ATTN_VALUE = ATTN_BLOCK * (1024 // 16)  # the 64 blocks of a 1024-token chunk, one layer


def chunk_sizes() -> list[int]:
    """Byte sizes of the values of one 1024-token chunk (Mamba layers first)."""
    return [MAMBA_VALUE] * MAMBA_LAYERS + [ATTN_VALUE] * ATTN_LAYERS


@dataclass
class Chunk:
    """A staging tensor holding one chunk, its per-value views, and the keys to store them."""

    staging: torch.Tensor
    views: list[torch.Tensor]
    keys: list[str]

    @property
    def nbytes(self) -> int:
        return int(self.staging.numel())


def make_chunk(prefix: str = "chunk0") -> Chunk:
    sizes = chunk_sizes()
    staging = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    offsets = np.cumsum([0, *sizes])
    views = [staging[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return Chunk(staging, views, [f"{prefix}/v{i}" for i in range(len(sizes))])


def median_seconds(fn: Callable[[], object], setup: Callable[[], object] = lambda: None,
                   rounds: int = 20, warmup: int = 2) -> float:
    """Median wall time of ``fn`` over ``rounds`` (``setup`` untimed before each)."""
    times = []
    for i in range(warmup + rounds):
        setup()
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def check_all_ok(outcomes: list) -> None:
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outcomes)} failed, first: {bad[0]}")


def store_rows(store: Store, chunk: Chunk, rounds: int, label: str) -> list[tuple[str, float]]:
    """(label, seconds) for a put (store emptied before each) and a get of one chunk."""
    out = torch.empty_like(chunk.staging)
    out_views = [out[v.storage_offset():v.storage_offset() + v.numel()] for v in chunk.views]
    put = median_seconds(lambda: check_all_ok(store.put_batch(chunk.keys, chunk.views)),
                         setup=store.remove_all, rounds=rounds)
    store.remove_all()
    check_all_ok(store.put_batch(chunk.keys, chunk.views))
    get = median_seconds(lambda: check_all_ok(store.get_batch(chunk.keys, out_views)),
                         rounds=rounds)
    if not torch.equal(out, chunk.staging):
        raise RuntimeError(f"{label}: loaded bytes differ from saved bytes")
    return [(f"{label} put (save)", put), (f"{label} get (load)", get)]


def run(rounds: int, with_mooncake: bool) -> list[tuple[str, float]]:
    chunk = make_chunk()
    dst = torch.empty_like(chunk.staging)
    rows = [("torch copy (baseline)", median_seconds(lambda: dst.copy_(chunk.staging),
                                                      rounds=rounds))]
    src_np, dst_np = chunk.staging.numpy(), dst.numpy()
    rows.append(("numpy copyto (single-threaded memcpy)",
                 median_seconds(lambda: np.copyto(dst_np, src_np), rounds=rounds)))
    with MemoryStore(1 << 30) as mem:
        rows += store_rows(mem, chunk, rounds, "memory")
    cold = [MemoryStore(1 << 30)]  # a fresh store per round: every page is touched first time
    rows.append(("memory put, cold (fresh store, first-touch pages)", median_seconds(
        lambda: check_all_ok(cold[0].put_batch(chunk.keys, chunk.views)),
        setup=lambda: cold.__setitem__(0, MemoryStore(1 << 30)), rounds=max(3, rounds // 4))))
    if with_mooncake:
        rows += mooncake_rows(chunk, rounds)
    return rows


def mooncake_rows(chunk: Chunk, rounds: int) -> list[tuple[str, float]]:
    """Mooncake on loopback: this process owns the 512 MiB segment (tcp, memcpy path)."""
    from tailproof.conformance.harness.local_master import LocalMaster
    from tailproof.impl.stores.mooncake import unavailable_reason

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads
    reason = unavailable_reason()
    if reason:
        print(f"(mooncake skipped: {reason})", file=sys.stderr)
        return []
    with LocalMaster() as master, make_store(
            {"backend": "mooncake", "master_address": master.address,
             "global_segment_size": 512 * MIB, "local_buffer_size": 16 * MIB}) as store:
        rows = store_rows(store, chunk, rounds, "mooncake (unregistered, per-call register)")
        store.register_buffer(chunk.staging)
        rows += store_rows(store, chunk, rounds, "mooncake (registered staging)")
        store.unregister_buffer(chunk.staging)
    return rows


def paired(rounds: int) -> str:
    """Interleaved rounds: torch copy (default threads), torch copy (1 thread), memory put
    (store emptied untimed before), memory get; paired ratios per round."""
    chunk = make_chunk("paired")
    dst = torch.empty_like(chunk.staging)
    out = torch.empty_like(chunk.staging)
    out_views = [out[v.storage_offset():v.storage_offset() + v.numel()] for v in chunk.views]
    threads = torch.get_num_threads()
    times: dict[str, list[float]] = {"copy": [], "copy1": [], "put": [], "get": []}

    def timed(fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    with MemoryStore(1 << 30) as mem:
        check_all_ok(mem.put_batch(chunk.keys, chunk.views))  # warm: pages faulted, arrays pooled
        for r in range(rounds + 1):
            c = timed(lambda: dst.copy_(chunk.staging))
            torch.set_num_threads(1)
            c1 = timed(lambda: dst.copy_(chunk.staging))
            torch.set_num_threads(threads)
            mem.remove_all()
            p = timed(lambda: check_all_ok(mem.put_batch(chunk.keys, chunk.views)))
            g = timed(lambda: check_all_ok(mem.get_batch(chunk.keys, out_views)))
            if r:
                for k, v in zip(("copy", "copy1", "put", "get"), (c, c1, p, g), strict=True):
                    times[k].append(v)
        if not torch.equal(out, chunk.staging):
            raise RuntimeError("memory get returned other bytes")
    ms = {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items()}
    lines = [f"Interleaved, {rounds} rounds; ms min / median; paired ratio = copy / store "
             "(min / median)", "",
             "| peer | copy ms | put ms | get ms | put ratio | get ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for peer, label in (("copy", f"torch copy, {threads} threads"),
                        ("copy1", "torch copy, 1 thread")):
        rp = [a / b for a, b in zip(times[peer], times["put"], strict=True)]
        rg = [a / b for a, b in zip(times[peer], times["get"], strict=True)]
        lines.append(f"| {label} | {ms[peer][0]:.1f} / {ms[peer][1]:.1f} | "
                     f"{ms['put'][0]:.1f} / {ms['put'][1]:.1f} | "
                     f"{ms['get'][0]:.1f} / {ms['get'][1]:.1f} | "
                     f"{min(rp):.2f} / {statistics.median(rp):.2f} | "
                     f"{min(rg):.2f} / {statistics.median(rg):.2f} |")
    return "\n".join(lines)


def table(rows: list[tuple[str, float]], nbytes: int) -> str:
    base = rows[0][1]
    lines = [f"One chunk = {len(chunk_sizes())} values, {nbytes:,} B ({nbytes / MIB:.1f} MiB); "
             "median of rounds.", "",
             "| operation | ms / chunk | GB/s | ratio vs torch copy |", "|---|---:|---:|---:|"]
    for name, secs in rows:
        lines.append(f"| {name} | {secs * 1e3:.1f} | {nbytes / secs / 1e9:.2f} | "
                     f"{base / secs:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--busy", action="store_true", help="paired part with one busy core")
    ap.add_argument("--paired-only", action="store_true")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()}")
    if not args.paired_only:
        print(table(run(args.rounds, not args.no_mooncake), sum(chunk_sizes())))
        print()
    busy = None
    if args.busy:
        import subprocess

        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        print(("With one busy core beside it. " if busy else "") + paired(args.rounds))
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
