"""Which vLLM is in use, and whether it has the API the vLLM-backed adapters call.

The adapters drive vLLM internals (``KVCacheManager``, the Mamba split of ``Scheduler``, the
Mooncake store connector) whose signatures change between releases; a changed keyword turns
every lookup into ``{"error": "TypeError"}`` and a run that looks like 24 divergences. So
before running, the version is detected without importing vLLM (package metadata, or a
source checkout's ``vllm/_version.py``), and every function, parameter and field the adapters
use is probed against that release's own table (the shapes differ between 0.33 and 0.34). A
supported installed release with every probe passing runs; anything else is refused with exit 2
naming the version and each missing or changed API.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: releases the vLLM-backed adapters are verified against, each with its own probe table
#: (release_probes); an installed release is supported when its major.minor is one of them
RELEASES = ("0.33", "0.34")
SUPPORTED = ((0, 33, 0), (0, 35, 0))  # [low, high): the releases above, contiguous
SUPPORTED_TEXT = ">=0.33.0,<0.35"
FIX = "pip install --no-deps vllm==0.34.0 or vllm==0.33.0 (./scripts/bootstrap.sh installs " \
      "both), or run the reference adapter only (--adapters reference)"

_KM = "vllm.v1.core.kv_cache_manager"
_KI = "vllm.v1.kv_cache_interface"
_KU = "vllm.v1.core.kv_cache_utils"
_SO = "vllm.v1.core.sched.output"
_MS = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
_CONN = "vllm.distributed.kv_transfer.kv_connector.v1"


@dataclass(frozen=True)
class Probe:
    """One API the adapters use: ``module:Attr[.member]`` and the parameters (or dataclass
    fields / attributes) it must take."""

    target: str
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()


CORE_PROBES: tuple[Probe, ...] = (
    Probe(f"{_KM}:KVCacheManager.__init__", ("kv_cache_config", "max_model_len",
          "scheduler_block_size", "hash_block_size", "enable_caching", "use_eagle",
          "enable_mamba_shared_prefix_checkpoint")),
    Probe(f"{_KM}:KVCacheManager.get_computed_blocks", ("request", "max_cache_hit_length")),
    Probe(f"{_KM}:KVCacheManager.allocate_slots", (
        "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks")),
    Probe(f"{_KM}:KVCacheManager", attrs=(
        "new_step_starts", "truncate_computed_blocks", "take_kv_cache_block_copies",
        "take_boundary_state_offloads", "finalize_partial_tail_offloads",
        "remove_skipped_blocks", "evict_blocks", "reset_prefix_cache", "get_block_ids",
        "get_block_ids_for_computed_tokens", "free")),
    Probe("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
          attrs=("take_pending_cow_copies",)),
    Probe("vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split", (
        "request", "num_new_tokens", "num_new_local_computed_tokens",
        "num_external_computed_tokens")),
    Probe(f"{_KI}:MambaSpec.__init__", ("block_size", "shapes", "dtypes", "mamba_cache_mode")),
    Probe(f"{_KI}:FullAttentionSpec.__init__", ("block_size", "num_kv_heads", "head_size",
                                                "dtype")),
    Probe(f"{_KI}:KVCacheGroupSpec.__init__", ("is_eagle_group",)),
    Probe(f"{_KI}:KVCacheConfig", attrs=("prefix_cacheable_groups",)),
    Probe(f"{_KI}:KVCacheConfig.__init__", ("num_blocks", "kv_cache_tensors", "kv_cache_groups",
                                            "prefix_cache_retention_interval")),
    Probe(f"{_KU}:get_request_block_hasher"),
    Probe(f"{_KU}:init_none_hash"),
    Probe("vllm.utils.hashing:sha256"),
    Probe("vllm.v1.request:Request.__init__", ("block_hasher",)),
)

MOONCAKE_PROBES: tuple[Probe, ...] = (
    Probe(f"{_MS}.coordinator:MooncakeStoreCoordinator.__init__", (
        "kv_cache_groups", "scheduler_block_size", "hash_block_size", "use_eagle",
        "retention_interval", "enable_partial_hash_hits")),
    Probe(f"{_MS}.data:ChunkedTokenDatabase", attrs=("set_kv_caches_base_addr",
                                                     "set_block_len")),
    Probe(f"{_MS}.data:MooncakeStoreWorkerMetadata"),
    Probe(f"{_MS}.scheduler:MooncakeStoreScheduler", attrs=(
        "bind_gpu_block_pool", "update_state_after_alloc", "build_connector_meta",
        "register_finished_partial_tail", "get_num_new_matched_tokens",
        "update_connector_output")),
    Probe(f"{_MS}.worker:KVCacheStoreSendingThread", attrs=("_handle_request",
                                                           "take_completed_saves")),
    Probe(f"{_MS}.worker:MooncakeStoreWorker", attrs=("lookup",
                                                     "_close_ended_store_requests")),
    Probe(f"{_SO}:KVConnectorBlockState"),
)

IMPL_PROBES: tuple[Probe, ...] = (
    Probe(f"{_CONN}.base:KVConnectorBase_V1"),
    Probe(f"{_CONN}.metrics:KVConnectorPromMetrics"),
    Probe(f"{_CONN}.metrics:KVConnectorStats"),
    Probe(f"{_KU}:resolve_kv_cache_block_sizes"),
    Probe(f"{_KU}:resolve_dcp_kv_block_size"),
    Probe(f"{_KU}:resolve_dcp_kv_cache_spec"),
    Probe(f"{_MS}.coordinator:ExternalCachedBlockPool"),
    Probe(f"{_MS}.data:chunk_hashes_for_block_size"),
)

#: What differs per release: the shapes the adapters' stand-ins and switches
#: (``conformance/vllm_release.py``, ``impl/vllm_release.py``) rely on in each.
RELEASE_CORE: dict[str, tuple[Probe, ...]] = {
    # Model Runner V1's shape: resumed rows are cached ones, listed by id
    # (Scheduler._make_cached_request_data); BlockHashToBlockMap holds blocks.
    "0.33": (Probe(f"{_SO}:CachedRequestData.__init__", ("req_ids", "resumed_req_ids",
                                                         "new_block_ids",
                                                         "num_computed_tokens")),
             Probe("vllm.v1.outputs:ModelRunnerOutput.__init__", ("req_ids", "req_id_to_index",
                                                                  "sampled_token_ids"))),
    # Resumed requests are new ones with prefill_token_ids (Scheduler.schedule); the lookup
    # bound goes through Request.get_max_cache_hit_length; token ids are a TokenBuffer;
    # BlockHashToBlockMap holds ids (_dup_ids); ModelRunnerOutput lost req_id_to_index.
    "0.34": (Probe(f"{_SO}:NewRequestData.__init__", ("req_id", "prompt_token_ids",
                                                      "block_ids", "num_computed_tokens",
                                                      "prefill_token_ids")),
             Probe(f"{_SO}:CachedRequestData.__init__", ("req_ids", "new_block_ids",
                                                         "num_computed_tokens")),
             Probe("vllm.v1.request:Request", attrs=("get_max_cache_hit_length",
                                                     "prefill_token_ids")),
             Probe("vllm.v1.token_buffer:TokenBuffer"),
             Probe("vllm.v1.core.block_pool:BlockHashToBlockMap.__init__", ("blocks",)),
             Probe("vllm.v1.outputs:ModelRunnerOutput.__init__", ("req_ids",
                                                                  "sampled_token_ids"))),
}
RELEASE_MOONCAKE: dict[str, tuple[Probe, ...]] = {
    # PoolKey and the layouts live in data.py; the database takes block_size.
    "0.33": (Probe(f"{_MS}.data:PoolKey", attrs=("build_prefix",)),
             Probe(f"{_MS}.data:RankLocalStoreLayout", attrs=("key_for",)),
             Probe(f"{_MS}.data:KeyMetadata.__init__", ("group_id",)),
             Probe(f"{_MS}.data:ChunkedTokenDatabase.__init__", ("metadata", "block_size",
                                                                 "hash_block_size"))),
    # layout.py holds them; the database takes chunk_size; the coordinator takes the
    # lookahead; the bare scheduler and worker need the attributes the adapter sets.
    "0.34": (Probe(f"{_MS}.layout:PoolKey", attrs=("build_prefix",)),
             Probe(f"{_MS}.layout:RankLocalStoreLayout", attrs=("key_for",)),
             Probe(f"{_MS}.layout:KeyMetadata.__init__", ("group_id",)),
             Probe(f"{_MS}.data:ChunkedTokenDatabase.__init__", ("metadata", "chunk_size",
                                                                 "hash_block_size")),
             Probe(f"{_MS}.coordinator:MooncakeStoreCoordinator.__init__",
                   ("num_hash_lookahead_tokens",)),
             Probe(f"{_MS}.scheduler:MooncakeStoreScheduler",
                   attrs=("register_finished_lookahead_save", "start_lookup_prefetch")),
             Probe(f"{_MS}.worker:LookupKeyClient", attrs=("lookup", "discard", "prefetch")),
             Probe(f"{_MS}.selective_lease:SelectiveLookupLease")),
}
def release_probes(release: str) -> dict[str, tuple[Probe, ...]]:
    """The probes each vLLM-backed adapter needs on ``release`` ("0.33" or "0.34")."""
    core = CORE_PROBES + RELEASE_CORE[release]
    mooncake = core + MOONCAKE_PROBES + RELEASE_MOONCAKE[release]
    return {"vllm": core, "vllm-mooncake": mooncake,
            "impl": mooncake + IMPL_PROBES}


#: the adapters the probes cover (the same names for every release)
ADAPTER_PROBES: dict[str, tuple[Probe, ...]] = release_probes(RELEASES[-1])


@dataclass
class VllmInfo:
    """The vLLM on the path: version, where it comes from, and what each probe found."""

    version: str | None  # None: not importable
    source: str  # "installed package", "source tree", or "not installed"
    path: str | None = None
    problems: dict[str, list[str]] = field(default_factory=dict)  # adapter -> API problems
    missing: str | None = None  # a module vLLM-backed adapters need that is absent
    #: the release whose probe table ``problems`` is against (None: not probed)
    release: str | None = None
    #: every release's table against this vLLM (``inspect_vllm(all_releases=True)``)
    release_problems: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def supported(self) -> bool:
        """An installed release one of RELEASES (a source tree is judged by its probes)."""
        if self.version is None:
            return False
        if self.source != "installed package":
            return True
        return release_of(self.version) is not None

    def as_json(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source, "path": self.path,
                "supported_range": SUPPORTED_TEXT, "supported": self.supported,
                "api_problems": self.problems, "missing": self.missing}


def release_of(version: str) -> str | None:
    """The supported release a version belongs to ("0.34" for 0.34.1), or None."""
    v = version_tuple(version)
    if v is None:
        return None
    name = f"{v[0]}.{v[1]}"
    return name if name in RELEASES else None


def installed_release() -> str:
    """The installed vLLM's ``major.minor`` ("0.34"), for text that names it."""
    v = version_tuple(detect().version or "")
    return f"{v[0]}.{v[1]}" if v is not None else "unknown"


def nearest_release(version: str | None) -> str:
    """The release whose probe table a vLLM outside the set is compared with: the oldest for
    an older one, the newest for a newer (or unreadable) one."""
    v = version_tuple(version or "")
    if v is not None and v < SUPPORTED[0]:
        return RELEASES[0]
    return RELEASES[-1]


def version_tuple(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def detect() -> VllmInfo:
    """Find vLLM on sys.path without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return VllmInfo(None, "not installed")
    pkg_dir = Path(spec.origin).resolve().parent
    try:
        dist = md.distribution("vllm")
        dist_dir = Path(str(dist.locate_file("vllm"))).resolve()
    except md.PackageNotFoundError:
        dist, dist_dir = None, None
    if dist is not None and dist_dir == pkg_dir:
        return VllmInfo(dist.version, "installed package", str(pkg_dir))
    version = None
    vf = pkg_dir / "_version.py"
    if vf.is_file():
        m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", vf.read_text())
        version = m[1] if m else None
    return VllmInfo(version or "unknown", "source tree", str(pkg_dir))


def _resolve(target: str) -> Any:
    module, _, qual = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def check_probe(p: Probe) -> str | None:
    """What is wrong with one probed API (None: as the adapters expect)."""
    name = p.target.split(":")[1].removesuffix(".__init__")
    try:
        obj = _resolve(p.target)
    except ImportError as e:
        module = p.target.split(":")[0]
        if isinstance(e, ModuleNotFoundError) and e.name == module:
            return f"{name}: no module {module}"
        return f"{name}: cannot import {module} ({e})"
    except AttributeError:
        return f"{name}: missing"
    except Exception as e:  # noqa: BLE001 - an import-time failure of a foreign version
        return f"{name}: import fails ({type(e).__name__}: {e})"
    missing = [a for a in p.attrs if not hasattr(obj, a)]
    if missing:
        return f"{name}: no {', '.join(missing)}"
    if p.params:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return f"{name}: signature cannot be read"
        accepts_kwargs = any(x.kind is x.VAR_KEYWORD for x in params.values())
        lacking = [a for a in p.params if a not in params]
        if lacking and not accepts_kwargs:
            return f"{name}: no parameter {', '.join(lacking)}"
    return None


def _missing_runtime() -> str | None:
    for mod in ("torch", "vllm"):
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except (ImportError, ValueError):
            return mod
    return None


def _probe_table(table: dict[str, tuple[Probe, ...]], names: list[str],
                 cache: dict[Probe, str | None]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in names:
        found = []
        for p in table[a]:
            if p not in cache:
                cache[p] = check_probe(p)
            if cache[p]:
                found.append(cache[p])
        if found:
            out[a] = found
    return out


def inspect_vllm(adapters: list[str] | None = None, all_releases: bool = False) -> VllmInfo:
    """Detect vLLM and probe the API of the named vLLM-backed adapters (all by default)
    against its release's table: an installed release's own; a source tree's by its version,
    else the first table it passes; a release outside the set, the nearest one's. With
    ``all_releases``, also every release's table (``release_problems``, for the doctor)."""
    info = detect()
    info.missing = _missing_runtime()
    if info.missing:
        return info
    names = [a for a in (adapters or list(ADAPTER_PROBES)) if a in ADAPTER_PROBES]
    cache: dict[Probe, str | None] = {}
    if all_releases:
        for r in RELEASES:
            info.release_problems[r] = _probe_table(release_probes(r), names, cache)
    release = release_of(info.version or "")
    if release is None and info.source == "source tree":
        release = next((r for r in RELEASES
                        if not _probe_table(release_probes(r), names, cache)), None)
    info.release = release or nearest_release(info.version)
    info.problems = _probe_table(release_probes(info.release), names, cache)
    return info


def refusal(info: VllmInfo, adapter: str) -> str | None:
    """Why ``adapter`` cannot run on this vLLM (None: it can)."""
    if adapter not in ADAPTER_PROBES:
        return None
    if info.missing:
        return f"adapter {adapter} needs {info.missing}, which is not installed"
    where = f"vLLM {info.version} ({info.source}{', ' + info.path if info.path else ''})"
    problems = info.problems.get(adapter, [])
    if not info.supported:
        text = (f"adapter {adapter}: {where} is outside the supported releases "
                f"{', '.join(RELEASES)} ({SUPPORTED_TEXT})")
        return text + (f"; API differences from {info.release}: {'; '.join(problems)}"
                       if problems else "")
    if problems:
        return (f"adapter {adapter}: {where} lacks the API it drives on {info.release}: "
                f"{'; '.join(problems)}")
    return None


def token_id_refusal(traces: list[Any], adapters: list[str]) -> str | None:
    """Why the vLLM-backed ``adapters`` cannot replay ``traces`` on this vLLM's token ids
    (None: they can): the first token id at or past ``vllm_release.token_id_limit`` (2^31 on
    0.34, whose ``Request`` holds int32 ids; the trace format allows ids below 2^63)."""
    backed = [a for a in adapters if a in ADAPTER_PROBES]
    if not backed:
        return None
    from tailproof.conformance.vllm_release import token_id_limit, token_id_text

    limit = token_id_limit()
    for t in traces:
        for i, op in enumerate(t.ops):
            big = max(op.get("tokens") or (0,))
            if big >= limit:
                return (f"{t.source}: op {i} ({op['op']}): token id {big} is not below "
                        f"{token_id_text(limit)}, the ids vLLM {detect().version}'s Request "
                        f"holds ({', '.join(backed)} cannot replay it)")
    return None
