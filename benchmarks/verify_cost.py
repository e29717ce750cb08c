"""What verified values cost: a worker's save and load of one 1024-token chunk, with the value
format's seal/verify (XXH3-128 checksum, optionally the MAC) against the same worker with
seal/verify skipped (headers still laid out, nothing computed or checked).

    .venv/bin/python benchmarks/verify_cost.py [--rounds 15] [--mac] [--store mooncake]

Geometry (the ~7B hybrid of ``store_throughput.py``, bf16): one attention group of 4 layers with
1024-token blocks (2 x 8 KV heads x 128 x 1024 x 2 B = 4 MiB per layer per block) and one Mamba
group of 24 layers (ssm 128 heads x 64 x 128 + conv state = 2,158,592 B per layer). One save =
``wait_for_save`` of a job putting the chunk's attention block and its Mamba state (2 values,
65.4 MiB: each block copied into its value, seal, one ``write_batch``), timed until the sender
thread finished it; one load = ``start_load`` of it into other blocks (one ``read_batch``,
verify, copy), timed until the receiver finished it. Rounds are interleaved
(checked, unchecked, checked, ...); the store is emptied (untimed) before every save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.meta import BoundaryPut, LoadJob, StoreJob, TailKeyBoundary, TailproofMeta
from tailproof.impl.stores import Store, make_store
from tailproof.impl.value_format import ValueCodec
from tailproof.impl.worker_side import WorkerSide

BS, H, NB = 1024, 16, 4
ATTN_LAYERS, MAMBA_LAYERS = 4, 24
CONV, SSM = (8192 + 2 * 8 * 128) * 3, 128 * 64 * 128  # bf16 elements per Mamba block
GEO = StoreGeometry(core_group_ids=(0, 1), block_sizes=(BS, BS), is_mamba=(False, True),
                hash_block_size=H, scheduler_block_size=BS, partial_hits=False, use_eagle=False,
                num_blocks=NB)
HASHES = [i.to_bytes(8, "little") * 4 for i in range(BS // H)]


class TimedCodec(ValueCodec):
    """The real codec, timing its own calls (its share of each operation, same round)."""

    spent = 0.0

    def seal(self, key: str, slot: Any) -> None:
        t0 = time.perf_counter()
        super().seal(key, slot)
        TimedCodec.spent += time.perf_counter() - t0

    def verify(self, key: str, slot: Any) -> str | None:
        t0 = time.perf_counter()
        out = super().verify(key, slot)
        TimedCodec.spent += time.perf_counter() - t0
        return out


class UncheckedCodec(ValueCodec):
    """The peer: same slot layout, no checksum computed, nothing verified."""

    def seal(self, key: str, slot: Any) -> None:
        return

    def verify(self, key: str, slot: Any) -> str | None:
        return None


def kv_caches() -> tuple[dict[str, Any], list[list[str]]]:
    g = torch.Generator().manual_seed(0)
    kv: dict[str, Any] = {}
    names: list[list[str]] = [[], []]
    for i in range(ATTN_LAYERS):
        kv[f"attn.{i}"] = torch.randn(2, NB, BS, 8, 128, generator=g).to(torch.bfloat16)
        names[0].append(f"attn.{i}")
    for i in range(MAMBA_LAYERS):
        kv[f"mamba.{i}"] = [torch.randn(NB, CONV, generator=g).to(torch.bfloat16),
                            torch.randn(NB, SSM, generator=g).to(torch.bfloat16)]
        names[1].append(f"mamba.{i}")
    return kv, names


def make_worker(store: Store, kv: dict[str, Any], names: list[list[str]], checked: bool,
                secret: bytes | None) -> WorkerSide:
    w = WorkerSide(Settings(namespace="bench", staging_buffer_bytes=80 << 20), GEO, store, 0, 1,
                   secret=secret, keep_load_outcomes=True)
    w.codec = (TimedCodec if checked else UncheckedCodec)(w.codec.fingerprint, secret)
    w.register_kv_caches(kv, names)
    return w


def one_round(w: WorkerSide, store: Store, job: int) -> tuple[float, float, float, float]:
    """(save s, load s, codec s within the save, codec s within the load)."""
    store.remove_all()
    w.saved_offset.clear()
    TimedCodec.spent = 0.0
    t0 = time.perf_counter()
    w.wait_for_save(TailproofMeta(stores=[StoreJob(
        store_job_id=job, req_id="A", token_len_chunk=BS, block_ids=([1], [1]),
        block_hashes=HASHES, boundary_puts=[BoundaryPut(1, 1, BS)])]))
    assert w.wait_idle(60.0)  # the save runs on the sender thread: time it to its end
    t1 = time.perf_counter()
    seal_s, TimedCodec.spent = TimedCodec.spent, 0.0
    w.start_load(TailproofMeta(loads=[LoadJob(
        req_id="B", block_ids=([2], [2]), block_hashes=HASHES, vllm_cached_tokens=0,
        kvpool_cached_tokens=BS, tail_key_boundaries=(TailKeyBoundary(0, BS),
                                                      TailKeyBoundary(1, BS)))]))
    assert w.wait_idle(60.0)
    t2 = time.perf_counter()
    verify_s = TimedCodec.spent
    w.take_transfer_results()
    w.build_connector_worker_meta()
    w.close_ended_store_requests({"A"}, set())
    assert w.load_ok.pop("B"), "load failed"
    return t1 - t0, t2 - t1, seal_s, verify_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mac", action="store_true", help="also authenticate (MAC) every value")
    ap.add_argument("--store", choices=["memory", "mooncake"], default="memory")
    args = ap.parse_args()
    secret = b"b" * 32 if args.mac else None
    master = None
    if args.store == "mooncake":
        from tailproof.conformance.harness.local_master import LocalMaster
        from tailproof.conformance.harness.netns import enter_loopback_namespace

        enter_loopback_namespace()
        master = LocalMaster().start()
        store = make_store({"backend": "mooncake", "master_address": master.address,
                            "global_segment_size": "512MB"})
    else:
        store = make_store({"backend": "memory", "capacity_bytes": "512MB"})
    kv, names = kv_caches()
    workers = {c: make_worker(store, kv, names, c, secret) for c in (True, False)}
    for c in (True, False):  # warm-up: page faults of staging and store
        one_round(workers[c], store, 0)
    times: dict[bool, list[tuple[float, float, float, float]]] = {True: [], False: []}
    try:
        for r in range(args.rounds):
            for c in (True, False) if r % 2 == 0 else (False, True):
                times[c].append(one_round(workers[c], store, r + 1))
    finally:
        for w in workers.values():
            w.close()
        store.close()
        if master is not None:
            master.stop()
            master.remove_private_log()
    print(f"store {args.store}, {'checksum + MAC' if args.mac else 'checksum'}, "
          f"{args.rounds} interleaved rounds, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| op | checked min / median ms | unchecked min / median ms | paired ratio "
          "min / median | seal/verify share of the checked op, median |")
    print("|---|---:|---:|---:|---:|")
    for i, op in enumerate(("save", "load")):
        a = [t[i] * 1e3 for t in times[True]]
        b = [t[i] * 1e3 for t in times[False]]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        # Codec time over the rest of the same operation: the overhead, immune to load drift.
        share = [t[2 + i] / (t[i] - t[2 + i]) for t in times[True]]
        print(f"| {op} | {min(a):.1f} / {statistics.median(a):.1f} | "
              f"{min(b):.1f} / {statistics.median(b):.1f} | "
              f"**{min(ratios):.3f}** / **{statistics.median(ratios):.3f}** | "
              f"+{100 * statistics.median(share):.1f}% |")


if __name__ == "__main__":
    main()
