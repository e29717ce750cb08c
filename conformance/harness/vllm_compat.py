"""Which vLLM is in use, and whether it has the API the vLLM-backed adapters call.

The adapters drive vLLM internals (``KVCacheManager``, the Mamba split of ``Scheduler``, the
Mooncake store connector) whose signatures change between releases; a changed keyword turns
every lookup into ``{"error": "TypeError"}`` and a run that looks like 24 divergences. So
before running, the version is detected without importing vLLM (package metadata, or a
source checkout's ``vllm/_version.py``), and every function, parameter and field the adapters
use is probed. A supported installed release with every probe passing runs; anything else is
refused with exit 2 naming the version and each missing or changed API.
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

#: releases the vLLM-backed adapters are verified against: [low, high)
SUPPORTED = ((0, 33, 0), (0, 34, 0))
SUPPORTED_TEXT = ">=0.33.0,<0.34"
FIX = "pip install --no-deps vllm==0.33.0 (./scripts/bootstrap.sh does), or run the " \
      "reference adapter only (--adapters reference / --against reference)"

_KM = "vllm.v1.core.kv_cache_manager"
_KI = "vllm.v1.kv_cache_interface"
_KU = "vllm.v1.core.kv_cache_utils"
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
    Probe(f"{_MS}.data:ChunkedTokenDatabase"),
    Probe(f"{_MS}.data:KeyMetadata.__init__", ("group_id",)),
    Probe(f"{_MS}.data:MooncakeStoreWorkerMetadata"),
    Probe(f"{_MS}.data:PoolKey"),
    Probe(f"{_MS}.scheduler:MooncakeStoreScheduler"),
    Probe(f"{_MS}.worker:KVCacheStoreSendingThread", attrs=("_handle_request",)),
    Probe(f"{_MS}.worker:MooncakeStoreWorker"),
    Probe("vllm.v1.core.sched.output:KVConnectorBlockState"),
)

IMPL_PROBES: tuple[Probe, ...] = (
    Probe(f"{_CONN}.base:KVConnectorBase_V1"),
    Probe(f"{_CONN}.metrics:KVConnectorPromMetrics"),
    Probe(f"{_CONN}.metrics:KVConnectorStats"),
    Probe(f"{_KU}:resolve_kv_cache_block_sizes"),
    Probe(f"{_KU}:resolve_dcp_kv_block_size"),
    Probe(f"{_KU}:resolve_dcp_kv_cache_spec"),
)

#: the probes each vLLM-backed adapter needs
ADAPTER_PROBES: dict[str, tuple[Probe, ...]] = {
    "vllm": CORE_PROBES,
    "vllm-mooncake": CORE_PROBES + MOONCAKE_PROBES,
    "impl": CORE_PROBES + MOONCAKE_PROBES + IMPL_PROBES,
}


@dataclass
class VllmInfo:
    """The vLLM on the path: version, where it comes from, and what each probe found."""

    version: str | None  # None: not importable
    source: str  # "installed package", "source tree", or "not installed"
    path: str | None = None
    problems: dict[str, list[str]] = field(default_factory=dict)  # adapter -> API problems
    missing: str | None = None  # a module vLLM-backed adapters need that is absent

    @property
    def supported(self) -> bool:
        """An installed release inside SUPPORTED (a source tree is judged by its probes)."""
        if self.version is None:
            return False
        if self.source != "installed package":
            return True
        v = version_tuple(self.version)
        return v is not None and SUPPORTED[0] <= v < SUPPORTED[1]

    def as_json(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source, "path": self.path,
                "supported_range": SUPPORTED_TEXT, "supported": self.supported,
                "api_problems": self.problems, "missing": self.missing}


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
        return f"{name}: cannot import {p.target.split(':')[0]} ({e})"
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


def inspect_vllm(adapters: list[str] | None = None) -> VllmInfo:
    """Detect vLLM and probe the API of the named vLLM-backed adapters (all by default)."""
    info = detect()
    info.missing = _missing_runtime()
    if info.missing:
        return info
    names = [a for a in (adapters or list(ADAPTER_PROBES)) if a in ADAPTER_PROBES]
    cache: dict[Probe, str | None] = {}
    for a in names:
        found = []
        for p in ADAPTER_PROBES[a]:
            if p not in cache:
                cache[p] = check_probe(p)
            if cache[p]:
                found.append(cache[p])
        if found:
            info.problems[a] = found
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
        text = f"adapter {adapter}: {where} is outside the supported range {SUPPORTED_TEXT}"
        return text + (f"; API differences: {'; '.join(problems)}" if problems else "")
    if problems:
        return f"adapter {adapter}: {where} lacks the API it drives: {'; '.join(problems)}"
    return None
