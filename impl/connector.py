"""``TailproofConnector``: the vLLM 0.33 KV connector users deploy.

Semantics: ``tailproof.reference.connector`` (the package as a whole). Mirrors vLLM 0.33's
``MooncakeStoreConnector`` (the ``KVConnectorBase_V1`` / ``SupportsHMA`` shell that dispatches
to ``MooncakeStoreScheduler`` and ``MooncakeStoreWorker``).

Load it with::

    --kv-transfer-config '{"kv_connector": "TailproofConnector",
                           "kv_connector_module_path": "tailproof.impl.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "memory"}}'

This module is only the vLLM-facing shell: it validates the configuration at start-up
(``config``), builds the store (``tailproof.impl.stores.make_store``) and delegates to the
scheduler role (``scheduler_side``) or the worker role (``worker_side``). It supports the hybrid
allocator (``SupportsHMA``): one request's blocks arrive as one list per KV cache group.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)

from tailproof.impl import junctions
from tailproof.impl.config import (
    ConfigError,
    Settings,
    StoreGeometry,
    check_store_placement,
    decode_checkpoint_retention,
    geometry_from_vllm,
    native_decode_checkpoints,
    parse_settings,
    resolve_divergent_hits,
    resolve_reuse_extension,
)
from tailproof.impl.fingerprint import Fingerprint, check_tensors, fingerprint_from_vllm
from tailproof.impl.hash_seed import random_seed_problem
from tailproof.impl.keys import INITIAL_EPOCH, KeySpace, new_epoch
from tailproof.impl.lookup import StoreLookup
from tailproof.impl.meta import TailproofMeta, TailproofWorkerMeta
from tailproof.impl.metrics import (
    SchedulerMetrics,
    TailproofPromMetrics,
    TailproofStats,
    WorkerMetrics,
)
from tailproof.impl.scheduler_side import SchedulerSide
from tailproof.impl.stores import Store, make_store
from tailproof.impl.value_format import SecretError, mac_identity_text, secret_from_env
from tailproof.impl.vllm_plugin import HOOK_VERSION
from tailproof.impl.vllm_release import (
    JUNCTION_HOOK_RELEASES,
    decode_checkpoints,
    junction_hook_supported,
)
from tailproof.impl.worker_side import WorkerSide

logger = logging.getLogger(__name__)

_SHARED_LOCK = threading.Lock()
#: longest a reset of a paused engine waits for the workers' store jobs (seconds)
RESET_DRAIN_S = 30.0
_SHARED: dict[str, list[Any]] = {}  # store config json -> [store, refcount]


def acquire_store(store_config: dict[str, Any]) -> Store:
    """One store per configuration per process, shared by the roles living in it.

    The memory store is process-local: with vLLM's in-process executor (one GPU) the scheduler
    role and the worker then see the same store. Mooncake clients are shared the same way.
    """
    key = json.dumps(store_config, sort_keys=True)
    with _SHARED_LOCK:
        ent = _SHARED.get(key)
        if ent is None:
            ent = _SHARED[key] = [make_store(store_config), 0]
        ent[1] += 1
        return ent[0]


def release_store(store: Store) -> None:
    """Drop one reference; the last one closes the store."""
    with _SHARED_LOCK:
        for key, ent in list(_SHARED.items()):
            if ent[0] is store:
                ent[1] -= 1
                if ent[1] <= 0:
                    del _SHARED[key]
                    store.close()
                return


def build_coordinator(
    geo: StoreGeometry, kv_cache_config: Any, dcp: int
) -> MooncakeStoreCoordinator:
    """vLLM's mirror of the core hit search, over the stored groups (DCP-resolved)."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_cache_spec

    groups = [
        replace(g, kv_cache_spec=resolve_dcp_kv_cache_spec(g.kv_cache_spec, dcp))
        for g in (kv_cache_config.kv_cache_groups[i] for i in geo.core_group_ids)
    ]
    return MooncakeStoreCoordinator(
        groups, geo.scheduler_block_size, geo.hash_block_size, use_eagle=geo.use_eagle,
        retention_interval=kv_cache_config.prefix_cache_retention_interval,
        enable_partial_hash_hits=geo.partial_hits,
    )


class TailproofConnector(KVConnectorBase_V1, SupportsHMA):
    """Partial-tail-aware KV offload to a memory or Mooncake store (see module docstring)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """``IN_PROCESS`` (vLLM 0.34 ``KVConnectorBase_V1.kv_cache_access``): workers reach the
        device KV cache only through torch copies into their own pinned host staging buffers
        (``data_plane``); nothing registers or exports it, so the extensible KV cache may back
        it with any allocation. vLLM 0.33 never asks. Called while vLLM resolves its config, in
        every process, so it imports nothing of ours."""
        from vllm.config.kv_transfer import KVCacheAccess  # deferred: 0.34 only

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """False: store keys are the core's plain block hashes, and the partial-tail arithmetic
        (``spec.arithmetic``: ck(P), the EAGLE proof margin) assumes them. vLLM 0.34's
        ``VllmConfig._resolve_num_hash_lookahead_tokens`` then keeps lookahead hashing off for
        this connector (and for a ``MultiConnector`` holding it); an engine that has it on
        anyway is refused at start-up (:func:`lookahead_problem`)."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. Store jobs own their block references, so nothing a
        preempted request still had in flight needs delivering; a dropped save is a miss."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """``divergent_local_hits``: vLLM 0.33's ``Scheduler._get_local_prefix_cache_hit`` then
        reports the full-attention hit (``KVCacheManager.get_computed_blocks_for_connector``)
        even where a Mamba state lags it. Sound here because every store hit carries the Mamba
        state at exactly its end (``lookup``) and every load restores it; with no external
        tokens vLLM reconciles to the hit all groups agree on, and a failed asynchronous load
        recomputes from 0 (``Scheduler._handle_failed_recving``)."""
        settings = getattr(self, "settings", None)
        return bool(settings is not None and settings.divergent_local_hits)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("TailproofConnector needs the KV cache config (vLLM >= 0.33)")
        tc = vllm_config.kv_transfer_config
        self.settings: Settings = parse_settings(tc.kv_connector_extra_config, tc.kv_role)
        self.geo: StoreGeometry = geometry_from_vllm(vllm_config, kv_cache_config)
        ns = self.settings.namespace
        if ns == "tailproof":
            ns = f"tailproof:{getattr(vllm_config.model_config, 'model', None) or 'model'}"
        self.settings = _with_namespace(self.settings, ns)
        # Engines whose bytes are not interchangeable must never read each other's values: the
        # layout fingerprint is part of every key (a difference is then a miss).
        self.fingerprint: Fingerprint = fingerprint_from_vllm(vllm_config, kv_cache_config,
                                                              self.geo)
        try:
            self.secret = secret_from_env()
        except SecretError as exc:
            raise ConfigError([str(exc)]) from exc
        lookahead = lookahead_problem(vllm_config)
        if lookahead is not None:
            raise ConfigError([lookahead])
        self.settings = self._resolve_parts(vllm_config, kv_cache_config)
        par = vllm_config.parallel_config
        # Workers of this engine (TP x PP): each stores its own shard, each reports every job.
        self.world = par.tensor_parallel_size * par.pipeline_parallel_size
        placement = check_store_placement(self.settings.store, par)
        if placement:
            raise ConfigError(placement)
        dcp = par.decode_context_parallel_size
        self.coord = build_coordinator(self.geo, kv_cache_config, dcp)
        # Per-group EAGLE flags as vLLM's store coordinator merges them (spec groups).
        self.geo = replace(self.geo, eagle_group_ids=frozenset(self.coord.eagle_group_ids))
        store_config = dict(self.settings.store_config)
        if role == KVConnectorRole.SCHEDULER and store_config["backend"] == "mooncake":
            store_config["global_segment_size"] = 0  # lookups only: contribute no memory
        self.store: Store = acquire_store(store_config)
        self.keys = KeySpace(self.settings.namespace, self.fingerprint.digest,
                             par.tensor_parallel_size, mac_identity_text(self.secret))
        # Prefix hashes that no other process can derive (impl/hash_seed.py): warned, not
        # refused -- this engine still hits its own stored values while it lives.
        self.hash_seed_problem = random_seed_problem(vllm_config.cache_config, os.environ)
        if self.hash_seed_problem is not None and role == KVConnectorRole.SCHEDULER:
            logger.warning("TailproofConnector: %s", self.hash_seed_problem)
        self._start_role(role, par)

    def _resolve_parts(self, vllm_config: Any, kv_cache_config: Any) -> Settings:
        """The settings with every part that depends on the engine settled (the reuse
        extension, vLLM's own decode checkpoints, divergent hits); a part asked for where it
        cannot run is a :class:`ConfigError`, an "auto" part left off is logged."""
        settings, geo = self.settings, self.geo
        if not settings.load_async and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError([
                "load_async=false needs a single KV cache group: a failed synchronous load is "
                "reported by block id, which vLLM cannot map back to requests with several "
                "groups (it would crash instead of recomputing)"])
        settings, reuse_errors, reuse_notes = resolve_reuse_extension(
            settings, geo, vllm_config, kv_cache_config)
        if reuse_errors:
            raise ConfigError(reuse_errors)
        settings, native_note = native_decode_checkpoints(settings, decode_checkpoints())
        if native_note is not None:
            reuse_notes.append(native_note)
        if decode_checkpoint_retention(settings, geo, kv_cache_config, decode_checkpoints()):
            reuse_notes.append("save_decode_cache: the core retains a Mamba state at every "
                               f"{geo.scheduler_block_size}-token boundary, as vLLM's "
                               "Mooncake connector sets it (prefix_cache_retention_interval)")
        settings, divergent_errors = resolve_divergent_hits(settings, geo, vllm_config)
        if divergent_errors:
            raise ConfigError(divergent_errors)
        for note in reuse_notes:
            logger.info("TailproofConnector: %s", note)
        return settings

    def _start_role(self, role: KVConnectorRole, par: Any) -> None:
        """The scheduler role's side (with its store lookup) or this rank's worker side."""
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            lookup = StoreLookup(self.geo, self.coord, self.store.exists, self.keys,
                                 self.world, self.store.removal_count, self.store.change_count)
            self.scheduler_side = SchedulerSide(self.settings, self.geo, lookup,
                                                self.world, SchedulerMetrics())
        else:
            rank = _rank(par)
            self.worker_side = WorkerSide(
                self.settings, self.geo, self.store, rank, self.world, self.coord,
                WorkerMetrics(), fingerprint=self.fingerprint, secret=self.secret,
                tp_size=par.tensor_parallel_size)
        logger.info("TailproofConnector %s: store=%s fingerprint=%s%s geometry=%s", role.name,
                    self.settings.store, self.fingerprint.digest,
                    (f" (values authenticated, MAC identity {self.keys.mac_identity})"
                     if self.secret else ""), self.geo)

    # ------------------------------------------------------------------ scheduler role

    def _sched(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "scheduler-role method on a worker connector"
        return self.scheduler_side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched().bind_gpu_block_pool(gpu_block_pool)

    def on_scheduler_built(self, scheduler: Any) -> None:
        """The scheduler hook (``tailproof.impl.vllm_plugin``, contract
        ``tailproof-scheduler-hook/1``): with ``junction_checkpoints`` on, make vLLM 0.33's
        junction stop exact (``Scheduler.mamba_shared_prefix_checkpoint``; vLLM sets it only
        with an EAGLE Mamba group). Refused on a vLLM release whose names it has not been
        checked against (``vllm_release.JUNCTION_HOOK_RELEASES``)."""
        side = self.scheduler_side
        if side is None or not self.settings.junction_checkpoints:
            return
        import vllm

        if not junction_hook_supported(str(vllm.__version__)):
            logger.error("TailproofConnector: junction_checkpoints needs vLLM %s (running %s); "
                         "no junction stops", " or ".join(JUNCTION_HOOK_RELEASES),
                         vllm.__version__)
            return
        if not getattr(scheduler, "mamba_partial_cache_hit", False):
            logger.error("TailproofConnector: junction_checkpoints needs partial hash hits (a "
                         "hybrid model whose Mamba block is larger than prefix_match_unit); "
                         "no junction stops")
            return
        scheduler.mamba_shared_prefix_checkpoint = True
        kvm = getattr(scheduler, "kv_cache_manager", None)
        if self.settings.device_junctions:
            junctions.key_device_junctions(kvm)  # a module attribute: the jn-* mutants
        side.ext.junction_hook_ran(  # exact stops; whether vLLM keys its own junction states
            vllm_keys_junctions=bool(getattr(kvm, "mamba_shared_prefix_checkpoint", True)))
        logger.info("TailproofConnector: exact junction stops on (%s)", HOOK_VERSION)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34, under ``--max-num-inflight-kv-loads`` (``SchedulerSide.may_load_async``)."""
        return self._sched().may_load_async(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)  # jobs carry their epoch

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(
            connector_output.kv_connector_worker_meta, connector_output.failed_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Flush the request's turn-end checkpoint, if any (``SchedulerSide.finish_turn``).
        Store jobs hold their own block references: a finishing request never waits."""
        self._sched().finish_turn(request, block_ids)
        return False, None

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self._sched().register_finished_partial_tail(
            request, block_ids, partial_tail_offloads)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    @property
    def epoch(self) -> str:
        """This engine's current key epoch (the scheduler role's; workers use each job's)."""
        side = self.scheduler_side
        return side.epoch if side is not None else INITIAL_EPOCH

    def drain_for_reset(self, collective_rpc: Any, timeout: float = RESET_DRAIN_S) -> bool:
        """Before a prefix-cache reset of a paused engine (``EngineCore._reset_caches``, which
        ``pause_scheduler(clear_cache=True)`` calls; the vLLM plugin wires it): finish every
        worker's store jobs and take their reports now, so the jobs' pins are released.

        Why: a paused scheduler runs no step, so no worker report arrives and the pins stay;
        ``BlockPool.reset_prefix_cache`` then fails (blocks in use) and, with
        ``reset_running_requests``, vLLM 0.33's ``Scheduler.reset_prefix_cache`` raises. The
        pins must not simply be dropped: a job may still be reading those blocks. Jobs still
        running after ``timeout`` keep theirs (the reset then fails as before, bounded).
        Returns whether no pin is left."""
        side = self.scheduler_side
        if side is None or not side.has_pending_push_work():
            return True
        agg: TailproofWorkerMeta | None = None
        for meta in collective_rpc(drain_worker, args=(timeout,)) or []:
            if isinstance(meta, TailproofWorkerMeta):
                agg = meta if agg is None else agg.aggregate(meta)
        if agg is not None:
            side.update_connector_output(agg)
        return not side.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        """Make this engine's stored KV unreachable for it: move to a fresh key epoch.

        Nothing is removed: the pool may be shared with other engines (their keys stay
        reachable), and this engine's old entries age out by the store's lease and eviction.
        A reset that fails moves nothing: vLLM's ``Scheduler.reset_prefix_cache`` calls this
        even when its own block-pool reset failed (blocks in use), and KV still held in those
        blocks predates the reset (``SchedulerSide.reset_refusal``)."""
        side = self.scheduler_side
        if side is None:
            return None
        refusal = side.reset_refusal()
        if refusal is not None:
            logger.warning("TailproofConnector: prefix cache reset refused (%s); store key "
                           "epoch stays %s", refusal, side.epoch)
            return False
        side.reset()
        side.move_epoch(new_epoch())
        logger.info("TailproofConnector: prefix cache reset; store key epoch now %s", side.epoch)
        return True

    # ------------------------------------------------------------------ worker role

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "worker-role method on a scheduler connector"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = [self._kv_cache_config.kv_cache_groups[g] for g in self.geo.core_group_ids]
        worker = self._worker()
        worker.register_kv_caches(kv_caches, [g.layer_names for g in groups])
        assert worker.layout is not None
        problems = check_tensors(worker.layout.layer_bytes, worker.layout.layer_page_shapes,
                                 worker.layout.layer_itemsizes,
                                 [(g.layer_names, g.kv_cache_spec) for g in groups])
        if problems:
            worker.close()
            raise ConfigError(["the registered KV cache tensors do not match the layout the "
                               "store keys describe (fingerprint "
                               f"{self.fingerprint.digest}):", *problems])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TailproofMeta)
        self._worker().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TailproofMeta)
        self._worker().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker().take_transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_error_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_connector_worker_meta()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        store = getattr(self, "store", None)
        if store is not None:
            self.store = None
            release_store(store)

    # ------------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> TailproofStats | None:
        side = self.scheduler_side or self.worker_side
        if side is None:
            return None
        stats = TailproofStats(data=side.metrics.drain())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TailproofStats:
        return TailproofStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TailproofPromMetrics:
        return TailproofPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def drain_worker(worker: Any, timeout: float) -> TailproofWorkerMeta | None:
    """Runs on every worker (``collective_rpc``, ``TailproofConnector.drain_for_reset``): wait
    up to ``timeout`` for this rank's store jobs, then hand over the report the next step's
    ``build_connector_worker_meta`` would have sent (taken here, so it is sent exactly once)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    if not isinstance(conn, TailproofConnector) or conn.worker_side is None:
        return None
    conn.worker_side.wait_idle(timeout)
    meta = conn.build_connector_worker_meta()
    return meta if isinstance(meta, TailproofWorkerMeta) else None


def lookahead_problem(vllm_config: Any) -> str | None:
    """Why this engine's block hashes cannot key the store, or None: vLLM 0.34 hashes each
    block over ``num_hash_lookahead_tokens`` extra tokens under EAGLE when the connector opts in
    (``VllmConfig._resolve_num_hash_lookahead_tokens``); vLLM 0.33 has no such field."""
    n = getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0
    if n <= 0:
        return None
    return (f"lookahead block hashes are on ({n} tokens): TailproofConnector keys the store by "
            "plain block hashes (fix: set speculative_config.disable_lookahead_block_hashes=true)")


def _with_namespace(s: Settings, ns: str) -> Settings:
    return replace(s, namespace=ns.replace("@", "_"))


def _rank(par: Any) -> int:
    """This worker's rank within the (tensor x pipeline) group."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group + get_pp_group().rank_in_group * (
            par.tensor_parallel_size)
    except Exception:  # no distributed state (single process / tests)
        return 0
