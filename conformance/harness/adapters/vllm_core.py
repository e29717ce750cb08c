"""``CoreBackend`` over vLLM's real ``KVCacheManager`` on CPU (0.33 or 0.34: the peer nobody
here wrote).

Chunks are planned by the scheduler's own ``Scheduler._mamba_block_aligned_split``, called
unbound on a stand-in ``self`` that carries exactly the attributes it reads. Hash keys are
mapped back to ``(group, boundary_tokens)`` through the block hashes of every request seen.
"""

from __future__ import annotations

import logging
import os
import warnings
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from tailproof.conformance.format.trace import TraceConfig
from tailproof.conformance.harness.adapters.core_base import ManagerBackend
from tailproof.conformance.harness.backend import KVObserver
from tailproof.conformance.vllm_release import hash_map_entries, resumed_as_cached

if TYPE_CHECKING:
    from tailproof.conformance.harness.adapters.base import ConnStep

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
warnings.filterwarnings("ignore", module="vllm")


def _vllm() -> SimpleNamespace:
    """Import the vLLM pieces lazily (a cold import takes seconds)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    # vLLM logs expected outcomes (a refused reset) as warnings; observations carry them.
    # (Set once: every setLevel clears the cache of each of vLLM's and torch's thousands of
    # loggers, a millisecond per driver.)
    log = logging.getLogger("vllm")
    if log.level != logging.ERROR:
        log.setLevel(logging.ERROR)
    return SimpleNamespace(
        torch=torch, SamplingParams=SamplingParams, sha256=sha256, KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher, Scheduler=Scheduler,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, MambaSpec=MambaSpec,
        SlidingWindowSpec=SlidingWindowSpec, Request=Request,
        RequestStatus=RequestStatus)


class VllmCoreBackend(ManagerBackend):
    """Drives one ``KVCacheManager`` the way ``Scheduler.schedule`` does."""

    def __init__(self, config: TraceConfig) -> None:
        v = self.v = _vllm()
        self.status = v.RequestStatus
        self.config = config
        groups = []
        for i, g in enumerate(config.groups):
            if g.is_mamba:
                spec = v.MambaSpec(block_size=g.block_size, shapes=((1,), (1,)),
                                   dtypes=(v.torch.float32, v.torch.float32),
                                   mamba_cache_mode="align",
                                   num_speculative_blocks=g.num_speculative_blocks)
            elif g.kind == "sliding_window":
                spec = v.SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1,
                                           head_size=1, dtype=v.torch.float32,
                                           sliding_window=g.sliding_window)
            else:
                spec = v.FullAttentionSpec(block_size=g.block_size, num_kv_heads=1,
                                           head_size=1, dtype=v.torch.float32)
            groups.append(v.KVCacheGroupSpec([f"layer{i}"], spec, is_eagle_group=g.eagle))
        kv_config = v.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups)
        self.manager = v.KVCacheManager(
            kv_config, max_model_len=config.max_model_len,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size, enable_caching=config.enable_caching,
            use_eagle=config.use_eagle,
            enable_mamba_shared_prefix_checkpoint=config.enable_mamba_shared_prefix_checkpoint)
        self.block_pool = self.manager.block_pool
        self.requests: dict[str, Any] = {}
        self.pending: dict[str, tuple[Any, int]] = {}
        # With an observer, CoW copies are taken from the managers as soon as they are queued
        # (per group, so a drain returns them in vLLM's order) and reported to it.
        self.observer: KVObserver | None = None
        self._queued_copies: list[list[tuple[Any, Any]]] = [
            [] for _ in self.manager.coordinator.single_type_managers]
        self._boundary_of: dict[bytes, int] = {}
        self._hashed: dict[int, int] = {}  # id(request) -> hashes already mapped
        self._all_requests: list[Any] = []
        self._split_self = self._make_split_self()

    @property
    def kv_cache_config(self) -> Any:
        return self.manager.kv_cache_config

    @property
    def partial_hits(self) -> bool:
        """vLLM's own answer (``HybridKVCacheCoordinator.enable_partial_hash_hits``, CO:694),
        the one every adapter over this backend uses."""
        return bool(self.manager.coordinator.enable_partial_hash_hits)

    def _make_split_self(self) -> SimpleNamespace | None:
        """The attributes ``Scheduler._mamba_block_aligned_split`` reads (SC:546-662)."""
        cfg = self.config
        mamba = [g.block_size for g in cfg.groups if g.is_mamba]
        if not mamba:
            return None  # need_mamba_block_aligned_split is False: no split
        partial = cfg.hash_block_size < cfg.scheduler_block_size and self.partial_hits
        return SimpleNamespace(
            block_size=cfg.scheduler_block_size,
            cache_config=SimpleNamespace(block_size=cfg.split_block_size or max(mamba)),
            hash_block_size=cfg.hash_block_size,
            max_num_scheduled_tokens=cfg.max_num_scheduled_tokens,
            scheduler_config=SimpleNamespace(
                long_prefill_token_threshold=cfg.long_prefill_token_threshold),
            use_eagle_block_drop=cfg.use_eagle,
            num_hash_lookahead_tokens=0,
            mamba_partial_cache_hit=partial,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
            # Scheduler.__init__: the split stops at the junction itself only when the
            # manager (which narrows the flag) will key the state there.
            mamba_shared_prefix_checkpoint=(
                partial and self.manager.mamba_shared_prefix_checkpoint),
            # Not read by the split: what the connector's scheduler hook reads (whether the
            # manager keys the state at vLLM's own junction).
            kv_cache_manager=self.manager,
        )

    # -- requests -----------------------------------------------------------------------
    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> int:
        v = self.v
        sp = v.SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, eos_token_id=None)
        req = v.Request(rid, list(prompt), sampling_params=sp, pooling_params=None,
                        block_hasher=v.get_request_block_hasher(self.config.hash_block_size,
                                                                v.sha256))
        self.requests[rid] = req
        self._all_requests.append(req)
        return len(req.block_hashes)

    def set_counters(self, rid: str, *, num_computed_tokens: int | None = None,
                     num_in_flight_tokens: int | None = None) -> None:
        r = self.requests[rid]
        before = r.num_computed_tokens
        if num_computed_tokens is not None:
            r.num_computed_tokens = num_computed_tokens
            if r.status in (self.v.RequestStatus.WAITING, self.v.RequestStatus.PREEMPTED):
                r.status = self.v.RequestStatus.RUNNING
        if num_in_flight_tokens is not None:
            r.num_in_flight_tokens = num_in_flight_tokens
        if (self.observer is not None and num_computed_tokens is not None
                and num_computed_tokens > before):
            self.observer.computed(rid, before, num_computed_tokens)

    # -- lookup, planning, allocation ---------------------------------------------------
    def lookup(self, rid: str, max_len: int | None) -> tuple[int, list[list[int]]]:
        req = self.requests[rid]
        if max_len is None:
            blocks, hit, junction = self.manager.get_computed_blocks(req)
        else:
            blocks, hit, junction = self.manager.get_computed_blocks(req, max_len)
        if req.num_computed_tokens == 0:
            # Scheduler.schedule assigns the junction at admission (num_computed_tokens == 0),
            # where _mamba_block_aligned_split and MambaManager.cache_blocks read it.
            req.shared_prefix_boundary = junction
        self.pending[rid] = (blocks, hit)
        return hit, [list(ids) for ids in blocks.get_block_ids()]

    @property
    def split_scheduler(self) -> SimpleNamespace | None:
        """The ``Scheduler`` attributes the split reads (None: no Mamba group, no split): what
        a scheduler hook (``TailproofConnector.on_scheduler_built``) sees and sets."""
        return self._split_self

    def plan_chunk(self, rid: str, num_new_tokens: int, hit_tokens: int, external: int) -> int:
        if self._split_self is None:
            return num_new_tokens
        return self.v.Scheduler._mamba_block_aligned_split(
            self._split_self, self.requests[rid], num_new_tokens, hit_tokens, external)

    def allocate(self, rid: str, num_new_tokens: int, *, use_hit: bool, external: int,
                 delay_cache: bool, lookahead: int, reserved: int = 0) -> list[list[int]] | None:
        req = self.requests[rid]
        blocks, hit = self.pending.pop(rid, (None, 0))
        if not use_hit:
            blocks, hit = None, 0
        new = self.manager.allocate_slots(
            req, num_new_tokens, num_new_computed_tokens=hit, new_computed_blocks=blocks,
            num_lookahead_tokens=lookahead, num_external_computed_tokens=external,
            delay_cache_blocks=delay_cache, reserved_blocks=reserved)
        self._report_copies()
        if new is None:
            return None
        # Scheduler.schedule: request.num_computed_tokens = hit + external (SC:1537).
        req.num_computed_tokens += hit + external
        req.status = self.v.RequestStatus.RUNNING
        return [list(ids) for ids in new.get_block_ids()]

    def truncate(self, rid: str, num_tokens: int) -> list[list[int]]:
        blocks, _ = self.pending[rid]
        out = self.manager.truncate_computed_blocks(blocks, num_tokens)
        return [list(ids) for ids in out.get_block_ids()]

    def block_ids_for_computed_tokens(self, rid: str) -> list[list[int]]:
        ids = self.manager.get_block_ids_for_computed_tokens(
            rid, self.requests[rid].num_computed_tokens)
        return [list(g) for g in ids]

    # -- copies, hand-offs, finish ------------------------------------------------------
    def _report_copies(self) -> None:
        """Move newly queued CoW copies into ``_queued_copies`` and report them (observer only;
        ``SingleTypeKVCacheManager.take_pending_cow_copies``, the drain vLLM itself uses)."""
        if self.observer is None:
            return
        new: list[tuple[int, int]] = []
        for queued, mgr in zip(self._queued_copies,
                               self.manager.coordinator.single_type_managers, strict=True):
            pairs = mgr.take_pending_cow_copies()
            queued.extend(pairs)
            new += [(src.block_id, dst.block_id) for src, dst in pairs]
        if new:
            self.observer.copies(new)

    def drain_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """``take_kv_cache_block_copies``: copies in group order, retained ids pair by pair."""
        if self.observer is None:
            copies, retained = self.manager.take_kv_cache_block_copies()
            return ([(c.src_block_id, c.dst_block_id) for c in copies],
                    [b.block_id for b in retained])
        self._report_copies()
        pairs = [p for queued in self._queued_copies for p in queued]
        for queued in self._queued_copies:
            queued.clear()
        return ([(src.block_id, dst.block_id) for src, dst in pairs],
                [b.block_id for pair in pairs for b in pair])

    def release(self, block_ids: list[int]) -> None:
        self.block_pool.free_blocks(self.block_pool.blocks[i] for i in block_ids)

    def finalize_tail(self, rid: str) -> list[tuple[int, int, int]]:
        return list(self.manager.finalize_partial_tail_offloads(self.requests[rid]))

    def remove_skipped(self, rid: str) -> None:
        req = self.requests[rid]
        self.manager.remove_skipped_blocks(
            rid, max(0, req.num_computed_tokens - req.num_in_flight_tokens),
            num_prompt_tokens=req.num_prompt_tokens)

    def free(self, rid: str) -> None:
        req = self.requests[rid]
        self.manager.free(req)
        req.status = self.v.RequestStatus.FINISHED_ABORTED

    def table(self, rid: str) -> list[list[int]]:
        return [list(ids) for ids in self.manager.get_block_ids(rid)]

    # -- inspection ---------------------------------------------------------------------
    def free_queue(self) -> list[int]:
        q = self.block_pool.free_block_queue
        out, b = [], q.fake_free_list_head.next_free_block
        while b is not None and b is not q.fake_free_list_tail:
            out.append(b.block_id)
            b = b.next_free_block
        return out

    def _boundary(self, block_hash: bytes) -> int:
        h = self.config.hash_block_size
        for req in self._all_requests:
            seen = self._hashed.get(id(req), 0)
            for k in range(seen, len(req.block_hashes)):
                self._boundary_of[bytes(req.block_hashes[k])] = (k + 1) * h
            self._hashed[id(req)] = len(req.block_hashes)
        return self._boundary_of[block_hash]

    def keys(self) -> list[tuple[int, int, int]]:
        out = []
        for key, ids in hash_map_entries(self.block_pool.cached_block_hash_to_block):
            group = int.from_bytes(key[-4:], "big")
            boundary = self._boundary(bytes(key[:-4]))
            out.extend((group, boundary, b) for b in ids)
        return sorted(out)


def scheduler_output(step: ConnStep) -> SimpleNamespace:
    """A stand-in ``SchedulerOutput`` with exactly the fields a connector's
    ``build_connector_meta`` reads, for one ``conn_step``, in the installed release's shape
    (``resumed_as_cached``): on 0.33 (Model Runner V1) cached requests list running ones
    first, then resumed ones (SC:1939), and new requests carry no ``prefill_token_ids``; on
    0.34 (``Scheduler.schedule``) a resumed request is a new one, in admission order, and every
    new request carries ``prefill_token_ids``: the prompt plus any outputs."""
    from vllm.v1.core.sched.output import KVConnectorBlockState

    as_cached = resumed_as_cached()
    new_reqs, cached = [], []
    for row in step.rows:
        if row.kind == "new" or (row.kind == "resumed" and not as_cached):
            req = step.ctx.request(row.rid)
            new_reqs.append(SimpleNamespace(
                req_id=row.rid, block_ids=tuple(list(g) for g in row.block_ids),
                num_computed_tokens=row.computed,
                prompt_token_ids=req.prompt_token_ids,
                prefill_token_ids=None if as_cached else list(req.all_token_ids)))
        else:
            cached.append(row)
    cached.sort(key=lambda r: r.kind == "resumed")
    cached_data = SimpleNamespace(
        req_ids=[r.rid for r in cached],
        new_block_ids=[r.block_ids if any(r.block_ids) else None for r in cached],
        num_computed_tokens=[r.computed for r in cached])
    if as_cached:
        cached_data.resumed_req_ids = {r.rid for r in cached if r.kind == "resumed"}
    block_state = KVConnectorBlockState(
        req_ids={r.rid for r in step.rows} | set(step.offloads),
        resolve_block_ids=lambda rid: tuple(list(g) for g in step.resolve(rid) or ()),
        boundary_state_offloads={rid: list(e) for rid, e in step.offloads.items()})
    return SimpleNamespace(
        finished_req_ids=set(step.finished), preempted_req_ids=set(step.preempted),
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_data,
        num_scheduled_tokens={r.rid: r.tokens for r in step.rows},
        kv_connector_block_state=block_state)
