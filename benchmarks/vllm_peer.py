"""vLLM 0.33's own ``MooncakeStoreConnector`` worker threads, fed the benchmark's store jobs.

Why: the step benchmark's peer. The same scheduler (``TailproofConnector``'s scheduler role)
emits the same jobs; instead of our worker, vLLM's real ``KVCacheStoreSendingThread``
(``mooncake/store/worker.py``) runs them on its own started thread, exactly as
``MooncakeStoreWorker.wait_for_save`` does: one ``add_request`` per job, the thread reads the
KV tensors at the addresses its ``RankLocalStoreLayout`` computed, and ``take_completed_saves``
reports finished jobs so the scheduler releases their pins.

The store is :class:`FakeMooncakeStore`, with the client API the thread calls
(``batch_is_exist``, ``batch_put_from_multi_buffers``): each value is copied once from the
KV addresses into the store's own arrays with ``ctypes.memmove`` (the GIL is released, as in
Mooncake's C++ client), then ``bytes / rate`` of wall time passes for a network link. Loads
are not run through vLLM's receiving thread: the step benchmark's timed rounds only save.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np


class FakeMooncakeStore:
    """Mooncake's ``MooncakeDistributedStore`` surface the sending thread uses, in memory."""

    def __init__(self, capacity_bytes: int, gbps: float | None = None) -> None:
        self.capacity = capacity_bytes
        self.rate = gbps * 1e9 if gbps else None
        self._data: OrderedDict[str, np.ndarray] = OrderedDict()
        self._free: dict[int, list[np.ndarray]] = {}  # evicted arrays, reused by size
        self._used = 0
        self._lock = threading.Lock()
        self.put_bytes = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        with self._lock:
            return [1 if k in self._data else 0 for k in keys]

    def _take(self, n: int) -> np.ndarray:
        while self._used + n > self.capacity and self._data:
            _, old = self._data.popitem(last=False)
            self._used -= old.nbytes
            self._free.setdefault(old.nbytes, []).append(old)
        self._used += n
        free = self._free.get(n)
        return free.pop() if free else np.empty(n, np.uint8)

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[list[int]],
                                     sizes: list[list[int]], config: Any = None) -> list[int]:
        total = 0
        for key, a, s in zip(keys, addrs, sizes, strict=True):
            n = sum(s)
            with self._lock:
                dst = self._take(n)
            off = 0
            for addr, size in zip(a, s, strict=True):
                ctypes.memmove(dst.ctypes.data + off, addr, size)  # releases the GIL
                off += size
            with self._lock:
                self._data[key] = dst
            total += n
        self.put_bytes += total
        if self.rate:
            time.sleep(total / self.rate)
        return [0] * len(keys)


class VllmSenderPeer:
    """One worker rank of vLLM's Mooncake store connector: its sending thread over ``kv``."""

    def __init__(self, kv: dict[str, Any], fa_layers: list[str], mamba_layers: list[str],
                 kv_cache_config: Any, num_blocks: int, kernel_ratio: int,
                 store: FakeMooncakeStore) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
            MooncakeStoreCoordinator,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            ChunkedTokenDatabase,
            KeyMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
            KVCacheStoreSendingThread,
        )
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        logging.getLogger(KVCacheStoreSendingThread.__module__).setLevel(logging.ERROR)
        groups = list(kv_cache_config.kv_cache_groups)
        h = kv_cache_config.hash_block_size
        sizes = [g.kv_cache_spec.block_size for g in groups]
        lcm = int(np.lcm.reduce(sizes))
        self.coord = MooncakeStoreCoordinator(groups, lcm, h, use_eagle=False,
                                              retention_interval=None,
                                              enable_partial_hash_hits=h < lcm)
        dbs = [ChunkedTokenDatabase(KeyMetadata("bench-vllm", 0, 0, 0, 0, group_id=g), bs, h)
               for g, bs in enumerate(sizes)]
        # Manager-block-first views of every tensor (vLLM's ``register_kv_caches`` does the
        # same through ``group_kernel_blocks``): FlashAttention K and V halves, Mamba states.
        fa_views = [group_kernel_blocks(kv[n][i], num_blocks) for n in fa_layers for i in (0, 1)]
        mamba_views = [t for n in mamba_layers for t in kv[n]]
        assert all(v.shape[0] == num_blocks for v in fa_views + mamba_views), kernel_ratio
        dbs[0].store_layout.register_kv_caches(fa_views, num_blocks)
        dbs[1].store_layout.register_kv_caches(mamba_views, num_blocks)
        self.thread = KVCacheStoreSendingThread(
            store, self.coord, dbs, lcm, 0, [1] * len(groups), "kv_both", threading.Event(),
            replicate_config=None)
        self.thread.start()
        self.data = __import__(
            "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data",
            fromlist=["ReqMeta", "BoundaryPut"])

    def wait_for_save(self, meta: Any) -> None:
        """``MooncakeStoreWorker.wait_for_save``: enqueue every store job; returns at once."""
        d = self.data
        for job in meta.stores:
            self.thread.add_request(d.ReqMeta(
                req_id=job.req_id, token_len_chunk=job.token_len_chunk,
                block_ids=job.block_ids, block_hashes=job.block_hashes, can_save=True,
                store_job_id=job.store_job_id,
                boundary_puts=[d.BoundaryPut(*b) for b in job.boundary_puts],
                prefill_end_tokens=job.num_prompt_tokens or None,
                completed_token_len=job.completed_token_len,
                publish_partial_tail=job.publish_partial_tail))
        for rid in meta.preempted_req_ids:
            self.thread.delete_finished_stored_request(rid)

    def completed_saves(self) -> dict[int, int]:
        return self.thread.take_completed_saves()

    def idle(self) -> bool:
        return self.thread.request_queue.unfinished_tasks == 0 and not any(
            self.thread.stored_requests.values())
