"""The connector's store path on a GPU against plain torch copies of the same bytes, per value size.

For each value size (64 KiB to 64 MiB) one group of ``n`` KV blocks of that size lives on the
device (``--total-mib`` in all). Interleaved rounds time, in this order:

* ``d2h``: torch's pinned device-to-host copy of all ``n`` blocks (one ``copy_``), the peer of
* ``put``: ``WorkerSide._put``, the sender's batch path: ``exists``, device-to-host copies into
  pinned staging on the copy stream, ``ValueCodec.seal``, the memory store's ``put_batch``;
* ``h2d``: torch's pinned host-to-device copy of the same bytes, the peer of
* ``get``: ``WorkerSide._get_values``, the receiver's path: the store's ``read_batch``, every
  value's header verified, then copied onto its block on the copy stream (the memory store hands
  out its own arrays: pageable memory), in batches that fit one staging buffer as ``_put`` splits
  its puts (a larger batch takes a temporary pinned buffer of its own);
* ``h2d-pageable``: torch's host-to-device copy from pageable memory, what ``get`` copies from.

Each ratio is peer time / store time per round (1.0: the store path runs at the copy's
bandwidth); min and median over the rounds. The loaded bytes are checked against the saved
ones. ``--device cpu`` runs the same on CPU tensors (no pinned memory, the peers plain host
copies): only to prove the script where there is no GPU (``scripts/device_check.sh``).

    python benchmarks/store_device_throughput.py [--device cuda] [--rounds 10] [--total-mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import StoreJob
from tailproof.impl.stores import make_store
from tailproof.impl.value_format import slot_nbytes
from tailproof.impl.worker_side import WorkerSide

KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
OPS = ("d2h", "put", "h2d", "get", "h2d-pageable")
PEERS = {"put": "d2h", "get": "h2d"}


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``4096`` -> bytes."""
    t = text.strip().upper()
    mult = {"K": KIB, "M": MIB}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    """One value size: the device blocks, a worker registered on them, the peers' buffers."""

    def __init__(self, size: int, total: int, device: torch.device) -> None:
        self.size = size
        self.n = max(2, total // size)
        self.device = device
        gen = torch.Generator().manual_seed(size)
        host = torch.randint(0, 256, (self.n, size), dtype=torch.uint8, generator=gen)
        self.kv = host.to(device)
        self.want = host  # what every load must bring back
        pin = device.type == "cuda"
        self.pinned = torch.empty_like(host, pin_memory=pin)
        self.pageable = host.clone()
        geo = StoreGeometry(core_group_ids=(0,), block_sizes=(16,), is_mamba=(False,),
                            hash_block_size=16, scheduler_block_size=16, partial_hits=False,
                            use_eagle=False, num_blocks=self.n)
        cap = self.n * slot_nbytes(size) + 64 * MIB
        self.store = make_store({"backend": "memory", "capacity_bytes": cap})
        self.settings = Settings()
        self.worker = WorkerSide(self.settings, geo, self.store, 0, 1)
        self.worker.register_kv_caches({"kv": self.kv}, [["kv"]])
        hashes = [b.to_bytes(8, "big") for b in range(self.n)]
        self.items = [(0, b, hashes[b]) for b in range(self.n)]
        self.job = StoreJob(store_job_id=0, req_id="bench", token_len_chunk=0, block_ids=([],),
                            block_hashes=hashes)
        self.keys = [self.worker.key(0, h) for h in hashes]
        per = max(1, self.settings.staging_buffer_bytes // slot_nbytes(size))
        self.batches = [range(i, min(i + per, self.n)) for i in range(0, self.n, per)]

    def put(self) -> None:
        if self.worker._put(self.job, self.items) != "ok":
            raise RuntimeError(f"{self.size} B values: the put failed")

    def get(self) -> None:
        for r in self.batches:
            if not self.worker._get_values([(0, b) for b in r], [self.keys[b] for b in r]):
                raise RuntimeError(f"{self.size} B values: the get failed")

    def timed(self, op: str) -> float:
        """Seconds of one ``op`` (untimed set-up first: a put starts from an empty store)."""
        if op == "put":
            self.store.remove_all()
        fn: Callable[[], Any] = {
            "d2h": lambda: self.pinned.copy_(self.kv, non_blocking=True),
            "h2d": lambda: self.kv.copy_(self.pinned, non_blocking=True),
            "h2d-pageable": lambda: self.kv.copy_(self.pageable, non_blocking=True),
            "put": self.put, "get": self.get}[op]
        sync(self.device)
        t = time.perf_counter()
        fn()
        sync(self.device)
        return time.perf_counter() - t

    def check_roundtrip(self) -> None:
        """Zero the blocks, load them back from the store, compare with what was saved."""
        self.kv.zero_()
        self.get()
        sync(self.device)
        if not torch.equal(self.kv.cpu(), self.want):
            raise RuntimeError(f"{self.size} B values: loaded bytes differ from saved bytes")

    def close(self) -> None:
        self.worker.close()
        self.store.close()


def measure(size: int, total: int, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Per op, the seconds of each round after one warm-up round."""
    b = Bench(size, total, device)
    try:
        times: dict[str, list[float]] = {op: [] for op in OPS}
        for r in range(rounds + 1):
            for op in OPS:
                t = b.timed(op)
                if r:
                    times[op].append(t)
        b.check_roundtrip()
        return times
    finally:
        b.close()


def rows(size: int, total_bytes: int, times: dict[str, list[float]]) -> list[str]:
    def gbs(t: float) -> float:
        return total_bytes / t / 1e9

    out = []
    for op in OPS:
        ts = times[op]
        line = (f"| {size // KIB} KiB | {op} | {min(ts) * 1e3:.2f} / "
                f"{statistics.median(ts) * 1e3:.2f} | {gbs(min(ts)):.1f} / "
                f"{gbs(statistics.median(ts)):.1f} |")
        peer = PEERS.get(op)
        if peer:
            ratio = [p / s for p, s in zip(times[peer], ts, strict=True)]
            line += f" {min(ratio):.2f} / {statistics.median(ratio):.2f} |"
        else:
            line += " |"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes per size and op")
    ap.add_argument("--sizes", default=",".join(f"{s // KIB}K" for s in SIZES),
                    help="value sizes, e.g. 64K,1M,64M")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"store_device_throughput: torch {torch.__version__} sees no CUDA device",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads; load {os.getloadavg()}")
    print(f"{args.total_mib} MiB per size and op, {args.rounds} rounds after one warm-up, "
          "interleaved d2h, put, h2d, get, h2d-pageable; ms and GB/s min / median; "
          "ratio = peer time / store time per round (put: d2h, get: h2d), min / median")
    print()
    print("| value | op | ms | GB/s | ratio to peer |")
    print("|---:|---|---:|---:|---:|")
    for text in args.sizes.split(","):
        size = parse_size(text)
        times = measure(size, args.total_mib * MIB, args.rounds, device)
        n = max(2, args.total_mib * MIB // size)
        for line in rows(size, n * size, times):
            print(line, flush=True)
    print(f"\nload after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
