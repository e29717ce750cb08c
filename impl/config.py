"""Start-up configuration of the Tailproof connector: parsed, validated, frozen.

Semantics: ``tailproof.reference.connector.config`` (role flags, ``StoreGeometry``). Mirrors
vLLM 0.33's ``MooncakeStoreScheduler.__init__`` / ``MooncakeStoreCoordinator.from_kv_cache_config``
(block sizes from ``resolve_kv_cache_block_sizes``, partial hits from
``cache_hit_alignment_tokens``, EAGLE groups from ``KVCacheGroupSpec.is_eagle_group``).

Why: a misconfigured offload tier must fail when vLLM starts, with one clear message per
problem, not silently serve wrong KV later. Two things are validated here:

* ``kv_connector_extra_config`` (unknown keys rejected, types and ranges checked, store
  settings checked), parsed into :class:`Settings`;
* the KV cache layout vLLM resolved (``KVCacheConfig`` + the engine's block sizes), reduced to
  the plain-int :class:`StoreGeometry` both connector roles compute with: h must divide every
  prefix-cacheable group's block size, Mamba groups must be in ``align`` mode, cross-attention
  is not offloadable.

Everything else in ``tailproof.impl`` takes these two frozen objects, so it can be driven in
tests without a ``VllmConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tailproof.spec.arithmetic import eagle_proof_margin, lcm_all

STORE_KINDS = ("memory", "mooncake")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


class ConfigError(ValueError):
    """The connector configuration is invalid; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid TailproofConnector configuration:\n{lines}")


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` after validation (every key: docs/deploy.md, "Flags")."""

    kv_role: str = "kv_both"
    store: str = "memory"
    store_config: dict[str, Any] = field(default_factory=dict)  # make_store() input
    namespace: str = "tailproof"
    put_batch_size: int = 64
    staging_buffer_bytes: int = 64 << 20
    enable_lookup: bool = True
    load_async: bool = True  # loads between steps; failures reported per request
    save_decode_cache: bool = False  # also save KV computed during decode (Mooncake's option)
    send_threads: int = 1  # background store-job threads per worker (a request stays on one)
    recv_threads: int = 1  # background load threads per worker
    max_queued_jobs: int = 64  # queued + running store jobs (and, apart, loads) per worker
    # Turn-end checkpoints (docs/reuse.md): store the state at the last hash boundary a request
    # computed (prompt + response), from a snapshot block the connector takes from vLLM's pool.
    # The reuse extension's parts: False (default), True, or None for "auto" (on where the
    # engine supports them, ``resolve_reuse_extension``; given as the string "auto").
    turn_end_checkpoints: bool | None = False
    checkpoint_slots: int = 32  # requests holding snapshot blocks at once (1..4096)
    checkpoint_reserve_blocks: int = 4  # free pool blocks a snapshot block must leave
    decode_boundary_saves: bool | None = False  # also store decode-time aligned Mamba states
    # Not a user key: ``decode_boundary_saves`` served by vLLM's own decode checkpoints
    # (``native_decode_checkpoints``), so rule 5's own attention puts are left to the
    # positional decode saves of ``save_decode_cache``.
    native_decode_boundaries: bool = False
    # Junction checkpoints (docs/junctions.md): stop a prompt's chunk at the prefix it shares
    # with an earlier prompt and store the state there (needs the scheduler hook plugin).
    junction_checkpoints: bool | None = False
    junction_index_blocks: int = 1 << 18  # prompt hash blocks remembered (LRU)
    # With junction_checkpoints: the hook also sets vLLM's manager-side junction keying
    # (KVCacheManager.mamba_shared_prefix_checkpoint, EAGLE-only in vLLM 0.33), so the junction
    # state stays on the device and is handed off like a prompt tail (docs/junctions.md).
    device_junctions: bool | None = False
    # With the extension on: a lookup whose prompt extends a Mamba boundary an in-flight store
    # job is putting (a turn that arrives as its predecessor finishes) waits for that job.
    checkpoint_lookup_wait: bool = True
    # Local hits whose attention prefix runs past a lagging Mamba state (docs/impl.md, "Divergent
    # local hits"): vLLM then asks the store for the rest, and a load restores the Mamba state
    # at its hit, so requests share the attention blocks of a prefix the device still holds
    # instead of each loading a private copy (``supports_divergent_local_hybrid_hits``).
    divergent_local_hits: bool | None = False  # None: "auto" (resolve_divergent_hits)
    # Pins (docs/deploy.md; not vLLM 0.33, whose ``_reference_save_blocks`` pins the whole
    # table for every normal save): a normal save pins only the blocks some rank can
    # still read, from the lowest saved offset every rank has reported (scheduler_side).
    readable_pins: bool = True
    # Most GPU blocks store jobs may pin at once, as a share of the pool (None: no bound); a
    # job past it is skipped and counted (``jobs_skipped_pin_budget``): a future miss.
    pin_budget_fraction: float | None = 0.25

    @property
    def reuse_extension(self) -> bool:
        """Whether any part of the reuse extension (docs/reuse.md) is on."""
        return bool(self.turn_end_checkpoints or self.decode_boundary_saves
                    or self.junction_checkpoints)

    @property
    def is_producer(self) -> bool:
        """Whether this instance saves prefills and claims boundary hand-offs
        (``KVTransferConfig.is_kv_producer``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def can_put(self) -> bool:
        """Whether workers write to the store at all (``MooncakeStoreWorker.can_put``:
        producers, or consumers saving decode)."""
        return self.is_producer or self.save_decode_cache


_SETTING_TYPES: dict[str, type | tuple[type, ...]] = {
    "store": str,
    "namespace": str,
    "put_batch_size": int,
    "enable_lookup": bool,
    "load_async": bool,
    "save_decode_cache": bool,
    "send_threads": int,
    "recv_threads": int,
    "max_queued_jobs": int,
    "turn_end_checkpoints": bool,
    "checkpoint_slots": int,
    "checkpoint_reserve_blocks": int,
    "decode_boundary_saves": bool,
    "junction_checkpoints": bool,
    "junction_index_blocks": int,
    "device_junctions": bool,
    "checkpoint_lookup_wait": bool,
    "divergent_local_hits": bool,
    "readable_pins": bool,
    "pin_budget_fraction": (int, float, type(None)),
}
MAX_CHECKPOINT_SLOTS = 4096
MAX_THREADS = 8  # data-plane threads per kind: copies are memory-bound, more only contend
#: bounds of the per-worker queue and of one store batch: far above any engine's need (a
#: step queues at most one job per scheduled request), low enough that a typo (2^40) fails
#: at start-up instead of sizing a deque or a key list by it
MAX_QUEUED_JOBS = 1 << 16
MAX_PUT_BATCH = 1 << 16
#: Size settings of the connector itself (same syntax as the store's: 67108864, "64MB", ...).
_SIZE_SETTINGS = ("staging_buffer_bytes",)


def _store_fields() -> set[str]:
    from dataclasses import fields

    from tailproof.impl.stores import StoreConfig

    return {f.name for f in fields(StoreConfig)} - {"backend"}


def parse_settings(extra: dict[str, Any] | None, kv_role: str | None) -> Settings:
    """Validate ``kv_connector_extra_config``; raise :class:`ConfigError` listing every problem.

    Keys are the connector's own (``store``, ``namespace``, ``put_batch_size``,
    ``staging_buffer_bytes``, ``enable_lookup``, ``load_async``, ``save_decode_cache``, the
    reuse extension's ``turn_end_checkpoints``, ``checkpoint_slots``,
    ``checkpoint_reserve_blocks``, ``decode_boundary_saves``, ``checkpoint_lookup_wait``) plus
    the chosen store's settings (``tailproof.impl.stores.StoreConfig`` fields, e.g.
    ``master_address``), given flat.
    """
    extra = dict(extra or {})
    # Read by the trace recorder's vLLM plugin (tailproof.conformance.capture.plugin).
    extra.pop("tailproof_record", None)
    problems: list[str] = []
    role = kv_role or "kv_both"
    if role not in ROLES:
        problems.append(f"kv_role {role!r} is not one of {', '.join(ROLES)}")
    store_keys = _store_fields()
    own = set(_SETTING_TYPES) | set(_SIZE_SETTINGS)
    for key in sorted(set(extra) - own - store_keys):
        problems.append(
            f"unknown key {key!r} in kv_connector_extra_config (known: "
            f"{', '.join(sorted(own | store_keys))})"
        )
    sizes: dict[str, int] = {}
    for key in _SIZE_SETTINGS:
        if key not in extra:
            continue
        from tailproof.impl.stores.config import check_size_fits, parse_size

        try:
            sizes[key] = parse_size(extra[key])
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if sizes[key] <= 0:
            problems.append(f"{key} must be positive, got {extra[key]!r}")
        elif bad := check_size_fits(key, sizes[key]):
            problems.append(bad)
    for key, typ in _SETTING_TYPES.items():
        if key not in extra:
            continue
        val = extra[key]
        if key in (*REUSE_PARTS, "divergent_local_hits") and val == "auto":
            continue
        # bool is an int subclass: reject True where a count is expected.
        if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
            want = getattr(typ, "__name__", typ)
            if key in (*REUSE_PARTS, "divergent_local_hits"):
                want = 'bool or "auto"'
            if key == "pin_budget_fraction":
                want = "a number in (0, 1] or null"
            problems.append(f"{key} must be {want}, got {val!r}")
    store = extra.get("store", "memory")
    if isinstance(store, str) and store not in STORE_KINDS:
        problems.append(f"store {store!r} is not one of {', '.join(STORE_KINDS)}")
    for key in ("put_batch_size", "max_queued_jobs", "send_threads", "recv_threads"):
        val = extra.get(key)
        if isinstance(val, int) and not isinstance(val, bool) and val <= 0:
            problems.append(f"{key} must be positive, got {val}")
    for key, most in (("send_threads", MAX_THREADS), ("recv_threads", MAX_THREADS),
                      ("max_queued_jobs", MAX_QUEUED_JOBS), ("put_batch_size", MAX_PUT_BATCH)):
        val = extra.get(key)
        if isinstance(val, int) and not isinstance(val, bool) and val > most:
            problems.append(f"{key} must be at most {most}, got {val}")
    problems += _check_staging_total(extra, sizes)
    val = extra.get("checkpoint_slots")
    if isinstance(val, int) and not isinstance(val, bool) and not 1 <= val <= MAX_CHECKPOINT_SLOTS:
        problems.append(f"checkpoint_slots must be in 1..{MAX_CHECKPOINT_SLOTS}, got {val}")
    val = extra.get("junction_index_blocks")
    if isinstance(val, int) and not isinstance(val, bool) and not 1 <= val <= 1 << 24:
        problems.append(f"junction_index_blocks must be in 1..{1 << 24}, got {val}")
    val = extra.get("pin_budget_fraction")
    if isinstance(val, bool) or (isinstance(val, (int, float)) and not 0 < val <= 1):
        problems.append(f"pin_budget_fraction must be a number in (0, 1] or null, got {val!r}")
    val = extra.get("checkpoint_reserve_blocks")
    if isinstance(val, int) and not isinstance(val, bool) and val < 0:
        problems.append(f"checkpoint_reserve_blocks must be >= 0, got {val}")
    ns = extra.get("namespace")
    if isinstance(ns, str) and (not ns or "@" in ns or not ns.isprintable()):
        # a key is "namespace@..." (impl/keys.py); a newline or other control character
        # would split a log line or a key listing in two
        problems.append(f"namespace must be non-empty and contain no '@' and no control "
                        f"characters, got {ns!r}")
    store_config = {"backend": store, **{k: v for k, v in extra.items() if k in store_keys}}
    if isinstance(store, str) and store in STORE_KINDS:
        problems += check_store_config(store_config)
    if problems:
        raise ConfigError(problems)
    kwargs = {k: extra[k] for k in _SETTING_TYPES if k in extra}
    kwargs.update({k: None for k in (*REUSE_PARTS, "divergent_local_hits")
                   if kwargs.get(k) == "auto"})
    return Settings(kv_role=role, store_config=store_config, **kwargs, **sizes)


def _check_staging_total(extra: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    """Each data-plane thread of a worker owns one staging buffer (``WorkerSide``'s
    ``StagingPool(send_threads + recv_threads, staging_buffer_bytes)``): their total must fit
    in this machine's memory too, not only one buffer."""
    from tailproof.impl.stores.config import check_size_fits

    staging = sizes.get("staging_buffer_bytes")
    threads = [extra.get(k, 1) for k in ("send_threads", "recv_threads")]
    if staging is None or not all(isinstance(t, int) and not isinstance(t, bool)
                                  and 1 <= t <= MAX_THREADS for t in threads):
        return []
    bad = check_size_fits(f"staging_buffer_bytes x (send_threads + recv_threads) = "
                          f"{staging} x {sum(threads)}", staging * sum(threads))
    return [bad] if bad and not check_size_fits("staging_buffer_bytes", staging) else []


#: ``distributed_executor_backend`` values whose worker runs in the scheduler's process:
#: vLLM 0.33 ``Executor.get_class`` maps them to ``UniProcExecutor`` and its subclass
#: ``ExecutorWithExternalLauncher``; ``ParallelConfig.__post_init__`` picks "uni" for one GPU
#: when none is set. "mp" (``MultiprocExecutor``) and "ray" start worker processes even at TP=1.
IN_PROCESS_EXECUTORS = ("uni", "external_launcher")


def _executor_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend
    try:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
    except ImportError:
        UniProcExecutor = None  # noqa: N806 - the class, when vLLM is importable
    if isinstance(backend, type) and UniProcExecutor is not None \
            and issubclass(backend, UniProcExecutor):
        return "uni"
    return getattr(backend, "__qualname__", repr(backend))


def check_store_placement(store: str, parallel_config: Any) -> list[str]:
    """Why ``store`` cannot serve this engine's process layout (empty when it can).

    The memory store is a dict inside one process: the scheduler's lookups see the worker's
    puts only when both run in the same process. Otherwise every lookup searches an empty
    store and silently never hits, so the engine is refused at start-up instead.
    """
    if store != "memory":
        return []
    world = parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size
    if world > 1:
        return [f"store 'memory' lives in one process, but this engine runs {world} worker "
                "processes (tensor/pipeline parallel); use \"store\": \"mooncake\""]
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    name = "uni" if backend is None else _executor_name(backend)
    if name not in IN_PROCESS_EXECUTORS:
        return [f"store 'memory' lives in one process, but distributed_executor_backend="
                f"{name!r} runs the worker in another process than the scheduler (its lookups "
                "would search an empty store and never hit); use \"store\": \"mooncake\", or "
                "distributed_executor_backend=\"uni\" (one GPU, in-process worker)"]
    return []


def check_store_config(store_config: dict[str, Any]) -> list[str]:
    """Problems with the store settings, as the store package words them (empty when valid)."""
    from tailproof.impl.stores import StoreConfig, StoreConfigError

    try:
        StoreConfig.from_dict(store_config)
    except StoreConfigError as exc:
        return [f"store setting {e}" for e in exc.errors]
    return []


@dataclass(frozen=True)
class StoreGeometry:
    """The block layout both roles compute with; indices are *store* group indices.

    A store group is a prefix-cacheable KV cache group (vLLM's ``prefix_cacheable_group_ids``),
    numbered by its position in that list (as MooncakeStore numbers them in its keys).
    """

    core_group_ids: tuple[int, ...]  # store index -> core KV cache group id
    block_sizes: tuple[int, ...]  # per store group (DCP-resolved)
    is_mamba: tuple[bool, ...]  # per store group
    hash_block_size: int  # h
    scheduler_block_size: int  # scheduler block size
    partial_hits: bool  # hits land on h (else on the lcm)
    use_eagle: bool  # EAGLE block drop (ck(P) one unit lower, FA proof margins)
    eagle_group_ids: frozenset[int] = frozenset()  # store groups with an EAGLE proof margin
    num_blocks: int = 0
    # Store groups of sliding-window attention (``SlidingWindowSpec``): no fine-grained hash
    # lookup, so their EAGLE proof margin is a whole block.
    window_group_ids: frozenset[int] = frozenset()
    # Every non-Mamba store group is plain full attention (``FullAttentionSpec`` /
    # ``MLAAttentionSpec``): its block table only grows while a request runs (no sliding
    # window or chunked-local frees), so the connector's append-only mirror of it is the
    # core's current table (False: store jobs read the core's tables each step).
    tables_append_only: bool = False

    @property
    def alignment(self) -> int:
        """A: the unit every lookup hit is a multiple of."""
        return self.hash_block_size if self.partial_hits else self.scheduler_block_size

    @property
    def mamba_group_ids(self) -> frozenset[int]:
        """Store groups holding Mamba states (``_boundary_state_group_ids``)."""
        return frozenset(i for i, m in enumerate(self.is_mamba) if m)

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def store_index(self, core_group_id: int) -> int | None:
        """Store index of a core group id (None: the group is not stored)."""
        try:
            return self.core_group_ids.index(core_group_id)
        except ValueError:
            return None

    def eagle_proof_margin(self, store_group: int) -> int:
        """EAGLE proof margin of a non-Mamba group, 0 when it has none
        (``MooncakeStoreCoordinator.eagle_proof_margin_by_group``: fine-grained only where the
        manager class ``supports_fine_grained_hash_lookup``, which a sliding window does not)."""
        if store_group not in self.eagle_group_ids or self.is_mamba[store_group]:
            return 0
        bs = self.block_sizes[store_group]
        fine = self.partial_hits and store_group not in self.window_group_ids
        return int(eagle_proof_margin(bs, self.hash_block_size, fine))

    def align_lookup_length(self, n: int) -> int:
        """Longest length a lookup may report for ``n`` tokens (floor to A)."""
        return n // self.alignment * self.alignment


def check_geometry(geo: StoreGeometry) -> list[str]:
    """Problems with a resolved layout (empty when the connector can serve it)."""
    problems: list[str] = []
    h = geo.hash_block_size
    if not geo.block_sizes:
        problems.append("no prefix-cacheable KV cache group: nothing to offload")
    if h <= 0:
        problems.append(f"hash block size must be positive, got {h}")
        return problems
    for i, bs in enumerate(geo.block_sizes):
        if bs % h:
            problems.append(
                f"hash block size h={h} does not divide block size {bs} of KV cache group "
                f"{geo.core_group_ids[i]}; set --prefix-match-unit to a divisor of every "
                "group's block size"
            )
    if geo.block_sizes and geo.scheduler_block_size != lcm_all(list(geo.block_sizes)):
        problems.append(
            f"scheduler block size {geo.scheduler_block_size} is not the lcm of the group block "
            f"sizes {list(geo.block_sizes)}"
        )
    return problems


def geometry_from_vllm(vllm_config: Any, kv_cache_config: Any) -> StoreGeometry:
    """Build and validate the :class:`StoreGeometry` of a running engine; raise ConfigError."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec, SlidingWindowSpec

    problems: list[str] = []
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    ids = tuple(kv_cache_config.prefix_cacheable_group_ids)
    groups = [kv_cache_config.kv_cache_groups[g] for g in ids]
    for gid, group in zip(ids, groups, strict=True):
        spec = group.kv_cache_spec
        if isinstance(spec, CrossAttentionSpec):
            problems.append(f"KV cache group {gid}: cross-attention cannot be offloaded")
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align":
            problems.append(
                f"KV cache group {gid}: Mamba group in mamba_cache_mode="
                f"{spec.mamba_cache_mode!r}; the connector needs 'align' "
                "(--enable-prefix-caching sets it in vLLM 0.33) to store exact boundary states"
            )
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
    if pcp > 1:
        problems.append(f"prefill context parallelism (PCP={pcp}) is not supported")
    try:
        lcm, h = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    except ValueError as exc:
        raise ConfigError(problems + [str(exc)]) from exc
    spec_cfg = vllm_config.speculative_config
    use_eagle = bool(spec_cfg is not None and spec_cfg.use_eagle_block_drop())
    alignment = kv_cache_config.cache_hit_alignment_tokens
    eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
    if use_eagle and not eagle_group_ids:
        eagle_group_ids = set(range(len(groups)))  # as vLLM: flag every group conservatively
    geo = StoreGeometry(
        core_group_ids=ids,
        block_sizes=tuple(resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for g in groups),
        is_mamba=tuple(isinstance(g.kv_cache_spec, MambaSpec) for g in groups),
        hash_block_size=h,
        scheduler_block_size=lcm,
        partial_hits=alignment is not None and alignment < lcm,
        use_eagle=use_eagle,
        eagle_group_ids=frozenset(eagle_group_ids),
        num_blocks=kv_cache_config.num_blocks,
        window_group_ids=frozenset(i for i, g in enumerate(groups)
                                   if isinstance(g.kv_cache_spec, SlidingWindowSpec)),
        tables_append_only=all(
            type(g.kv_cache_spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec")
            for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)),
    )
    problems += check_geometry(geo)
    if problems:
        raise ConfigError(problems)
    return geo


REUSE_PARTS = ("turn_end_checkpoints", "decode_boundary_saves", "junction_checkpoints",
               "device_junctions")
#: the parts that store a state between lcm boundaries, so mean nothing without partial hits
NEEDS_PARTIAL_HITS = ("turn_end_checkpoints", "junction_checkpoints", "device_junctions")


def resolve_reuse_extension(settings: Settings, geo: StoreGeometry, vllm_config: Any,
                            kv_cache_config: Any) -> tuple[Settings, list[str], list[str]]:
    """Settle each part of the reuse extension (docs/reuse.md) for this engine: a part left
    unset (auto) is on where it can run and has something to gain, off otherwise; a part set
    true where it cannot run is an error. Returns (settings, errors, notes on auto parts off)."""
    why = reuse_extension_limits(geo, vllm_config, kv_cache_config)
    if not any(geo.is_mamba) or not geo.partial_hits:
        idle = "no Mamba group with partial hash hits (nothing past vLLM 0.33 to reuse)"
    else:
        idle = ""
    errors: list[str] = []
    notes: list[str] = []
    values: dict[str, bool] = {}
    for key in REUSE_PARTS:
        asked = getattr(settings, key)
        if asked is True:
            errors += [f"{key}=true is not supported here: {w} (docs/reuse.md, Limits)"
                       for w in why]
            if key in NEEDS_PARTIAL_HITS and not geo.partial_hits:
                # docs/deploy.md ("Flags"): without partial hash hits a checkpoint lands on
                # the lcm, where vLLM 0.33's own store already saves: true is a mistake
                errors.append(f"{key}=true needs partial hash hits (hash_block_size below "
                              "the lcm of the group block sizes; docs/reuse.md)")
            values[key] = True
        elif asked is None:
            reason = "; ".join(why) or idle
            values[key] = not reason
            if reason:
                notes.append(f"{key} (auto) is off: {reason}")
        else:
            values[key] = False
    if values["device_junctions"] and not values["junction_checkpoints"]:
        # the keying acts only where the junction hook stops a chunk (junctions.py)
        why_off = "junction_checkpoints is off (device_junctions keys the junction stops it sets)"
        if settings.device_junctions is True:
            errors.append(f"device_junctions=true needs junction_checkpoints: {why_off}")
        else:
            notes.append(f"device_junctions (auto) is off: {why_off}")
        values["device_junctions"] = False
    return replace(settings, **values), errors, notes


def divergent_hits_limits(geo: StoreGeometry, vllm_config: Any) -> list[str]:
    """Why ``divergent_local_hits`` cannot run on this engine: a load restores only what lies
    past the local hit plus the Mamba state at its end, so a lagging sliding-window group (its
    window below the local hit) and EAGLE's dropped proof block would be left unrestored."""
    return [f"divergent_local_hits=true is not supported here: {w}"
            for w in _speculation_and_windows(geo, vllm_config)]


def resolve_divergent_hits(settings: Settings, geo: StoreGeometry, vllm_config: Any
                           ) -> tuple[Settings, list[str]]:
    """Settle ``divergent_local_hits``: true where it cannot run is an error; "auto" (None) is
    on where it can run and attention blocks are smaller than the Mamba block (a local
    attention hit then runs past the Mamba state; BENCHMARKS.md section 13: FA 16 under Mamba
    1,024 meets issue 22's goal only with it on, FA 1,024 only with it off)."""
    asked = settings.divergent_local_hits
    limits = divergent_hits_limits(geo, vllm_config)
    if asked is True:
        return settings, limits
    if asked is None:
        attn = [b for b, m in zip(geo.block_sizes, geo.is_mamba, strict=True) if not m]
        mamba = [b for b, m in zip(geo.block_sizes, geo.is_mamba, strict=True) if m]
        on = not limits and bool(attn and mamba) and min(attn) < max(mamba)
        return replace(settings, divergent_local_hits=on), []
    return settings, []


def _speculation_and_windows(geo: StoreGeometry, vllm_config: Any) -> list[str]:
    """What neither the reuse extension nor divergent hits can run with: speculative
    decoding (EAGLE included) and sliding-window groups."""
    why: list[str] = []
    if getattr(vllm_config, "speculative_config", None) is not None or geo.use_eagle:
        why.append("speculative decoding is configured")
    if geo.window_group_ids:
        groups = sorted(geo.core_group_ids[g] for g in geo.window_group_ids)
        why.append(f"KV cache group(s) {groups} use a sliding window")
    return why


def native_decode_checkpoints(settings: Settings, native: bool) -> tuple[Settings, str | None]:
    """Reuse rule 5 (``decode_boundary_saves``) served by vLLM's own mechanism where the release
    has one (``native``: ``vllm_release.decode_checkpoints``, vLLM 0.34): ``save_decode_cache``
    on, which there accepts the core's decode-time Mamba hand-offs at block boundaries
    (``MooncakeStoreScheduler._handle_boundary_state_offloads``) and saves decode attention KV
    positionally with the normal saves, and with it vLLM's retention override
    (:func:`decode_checkpoint_retention`). Rule 5's own attention puts up to each boundary are
    then redundant (same keys, same bytes) and left out. A producer only, as rule 5 is; the
    part stays on (its lookup wait, its refusals). Returns (settings, a note or None)."""
    if not (native and settings.decode_boundary_saves and settings.is_producer):
        return settings, None
    return (replace(settings, save_decode_cache=True, native_decode_boundaries=True),
            "decode_boundary_saves is served by vLLM's decode checkpoints "
            "(save_decode_cache on; docs/reuse.md, rule 5)")


def decode_checkpoint_retention(settings: Settings, geo: StoreGeometry, kv_cache_config: Any,
                                native: bool) -> bool:
    """vLLM 0.34's retention override, mirrored (``MooncakeStoreScheduler.__init__``,
    ``MooncakeStoreWorker.__init__``, ``mooncake/store/``: "Decode checkpoints become reusable
    Store boundaries"): with ``save_decode_cache``, a Mamba group and the core's default sparse
    retention (interval 0), the interval becomes the scheduler block size, so the core keeps,
    and hands off, the Mamba state at every block boundary decoding crosses. The connector is
    built before the ``KVCacheManager`` from the same ``KVCacheConfig`` (``Scheduler.__init__``).
    Not on vLLM 0.33 (``native`` false), whose connector drops those states (vllm#56972).
    Returns whether the interval was changed."""
    if not (native and settings.save_decode_cache and any(geo.is_mamba)
            and kv_cache_config.prefix_cache_retention_interval == 0):
        return False
    kv_cache_config.prefix_cache_retention_interval = geo.scheduler_block_size
    return True


def reuse_extension_limits(geo: StoreGeometry, vllm_config: Any, kv_cache_config: Any
                           ) -> list[str]:
    """Why the reuse extension (docs/reuse.md, "Limits") cannot run on this engine: a
    speculative step does not end on a known boundary, and a sliding window's store mask
    would need its own rule."""
    from vllm.v1.kv_cache_interface import MambaSpec

    why = _speculation_and_windows(geo, vllm_config)
    for gid in geo.core_group_ids:
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        if isinstance(spec, MambaSpec) and spec.num_speculative_blocks:
            why.append(f"Mamba KV cache group {gid} has {spec.num_speculative_blocks} "
                       "speculative block(s)")
    return why
