"""Trace format v1: load a JSON trace, validate it completely, and normalise its ops.

Nothing runs until the whole trace is valid. Every problem is one ``TraceError`` line naming
where it is (``config.hash_block_size``, ``ops[3].rid``) and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailproof.conformance.format import limits
from tailproof.conformance.format import ops as opspec
from tailproof.conformance.format.connector_config import validate_connector_config
from tailproof.conformance.format.tokens import TokenError, expand
from tailproof.conformance.format.trace_checks import CheckError, check_config, check_ops
from tailproof.conformance.format.trace_file import ReadRefused, read_trace_bytes
from tailproof.reference.geometry import KINDS, Geometry, GroupSpec
from tailproof.reference.releases import RELEASES
from tailproof.spec.arithmetic import lcm_all

FORMAT_TAG = "tailproof-trace/1"
GROUP_KINDS = KINDS


class TraceError(ValueError):
    """A malformed trace; ``str()`` is one line naming the location and the problem."""


# The engine geometry of a trace is the reference's ``Geometry`` (its groups, h, pool size and
# scheduler settings, with what vLLM 0.33 derives from them); a trace config adds what only a
# trace carries. ``GroupConfig`` is the reference's ``GroupSpec`` (one group of the config).
GroupConfig = GroupSpec


@dataclass(frozen=True)
class TraceConfig(Geometry):
    connector: dict[str, Any] | None = None
    # KVCacheConfig.prefix_cache_retention_interval: None = dense Mamba / sliding-window
    # checkpoints (the adapters' model); 0 or an interval = sparse (adapters.refusal).
    prefix_cache_retention_interval: int | None = None

    @property
    def sparse_retention(self) -> bool:
        """Whether the engine kept Mamba / sliding-window states sparsely (vLLM 0.33
        ``SingleTypeKVCacheManager.reachable_block_mask`` with an interval that is not None)."""
        return self.prefix_cache_retention_interval is not None and any(
            g.kind in ("mamba_align", "sliding_window") for g in self.groups)

    @property
    def block_sizes(self) -> list[int]:
        return [g.block_size for g in self.groups]


@dataclass
class Trace:
    name: str
    description: str
    config: TraceConfig
    ops: list[dict[str, Any]]
    source: str = "<trace>"
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def expectations(self) -> list[dict[str, Any] | None]:
        return [op.get("expect") for op in self.ops]


_CONFIG_KEYS = {
    "groups", "hash_block_size", "num_blocks", "enable_caching", "use_eagle", "max_model_len",
    "max_num_scheduled_tokens", "long_prefill_token_threshold", "split_block_size", "connector",
    "enable_mamba_shared_prefix_checkpoint", "prefix_cache_retention_interval", "vllm",
    "num_hash_lookahead_tokens",
}


def _err(source: str, where: str, msg: str) -> TraceError:
    return TraceError(f"{source}: {where}: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_config(doc: Any, source: str) -> TraceConfig:
    if not isinstance(doc, dict):
        raise _err(source, "config", "must be an object")
    unknown = sorted(set(doc) - _CONFIG_KEYS)
    if unknown:
        raise _err(source, f"config.{unknown[0]}", "unknown config key")
    groups_doc = doc.get("groups")
    if not isinstance(groups_doc, list) or not groups_doc:
        raise _err(source, "config.groups", "must be a non-empty list")
    groups: list[GroupConfig] = []
    seen_mamba = False
    for i, g in enumerate(groups_doc):
        where = f"config.groups[{i}]"
        if not isinstance(g, dict):
            raise _err(source, where, "must be an object")
        extra = sorted(set(g) - {"kind", "block_size", "eagle", "mamba_cache_mode",
                                 "sliding_window", "num_speculative_blocks"})
        if extra:
            raise _err(source, f"{where}.{extra[0]}", "unknown group key")
        kind = g.get("kind")
        mode = g.get("mamba_cache_mode", "align")
        if kind == "mamba" or (kind == "mamba_align" and mode != "align"):
            raise _err(source, f"{where}.kind",
                       f"Mamba groups must be in align mode (got {kind!r}, mode {mode!r})")
        if kind not in GROUP_KINDS:
            raise _err(source, f"{where}.kind", f"must be one of {list(GROUP_KINDS)}, got {kind!r}")
        if kind != "mamba_align" and seen_mamba:
            raise _err(source, f"{where}.kind", f"{kind} groups must precede Mamba groups")
        seen_mamba |= kind == "mamba_align"
        bs = g.get("block_size")
        if not _is_int(bs) or bs <= 0:
            raise _err(source, f"{where}.block_size", f"must be an int > 0, got {bs!r}")
        eagle = g.get("eagle", False)
        if not isinstance(eagle, bool):
            raise _err(source, f"{where}.eagle", "must be a bool")
        window = g.get("sliding_window")
        if kind == "sliding_window":
            if not _is_int(window) or window <= 0:
                raise _err(source, f"{where}.sliding_window",
                           f"must be an int > 0 for a sliding_window group, got {window!r}")
        elif window is not None:
            raise _err(source, f"{where}.sliding_window", "only sliding_window groups have one")
        spec_blocks = g.get("num_speculative_blocks", 0)
        if not _is_int(spec_blocks) or spec_blocks < 0:
            raise _err(source, f"{where}.num_speculative_blocks",
                       f"must be an int >= 0, got {spec_blocks!r}")
        if spec_blocks and kind != "mamba_align":
            raise _err(source, f"{where}.num_speculative_blocks", "only Mamba groups have them")
        groups.append(GroupConfig(kind, bs, eagle, window, spec_blocks))
    h = doc.get("hash_block_size")
    if not _is_int(h) or h <= 0:
        raise _err(source, "config.hash_block_size", f"must be an int > 0, got {h!r}")
    for i, g in enumerate(groups):
        if g.block_size % h:
            raise _err(source, "config.hash_block_size",
                       f"h={h} does not divide groups[{i}].block_size={g.block_size}")
    nb = doc.get("num_blocks")
    if not _is_int(nb) or nb < 2:
        raise _err(source, "config.num_blocks", f"must be an int >= 2, got {nb!r}")
    kw: dict[str, Any] = {}
    for key in ("enable_caching", "use_eagle", "enable_mamba_shared_prefix_checkpoint"):
        if key in doc:
            if not isinstance(doc[key], bool):
                raise _err(source, f"config.{key}", "must be a bool")
            kw[key] = doc[key]
    for key in ("max_model_len", "max_num_scheduled_tokens", "long_prefill_token_threshold"):
        if key in doc:
            v = doc[key]
            if not _is_int(v) or v < 0:
                raise _err(source, f"config.{key}", f"must be an int >= 0, got {v!r}")
            kw[key] = v
    if "split_block_size" in doc:
        v = doc["split_block_size"]
        if not _is_int(v) or v not in [g.block_size for g in groups]:
            raise _err(source, "config.split_block_size",
                       f"must be a group block size (the split's Mamba alignment unit), got {v!r}")
        kw["split_block_size"] = v
    if doc.get("prefix_cache_retention_interval") is not None:
        kw["prefix_cache_retention_interval"] = _retention(
            doc["prefix_cache_retention_interval"], groups, source)
    if len(groups) == 1 and kw.get("enable_caching", True) and h != groups[0].block_size:
        # UnitaryKVCacheCoordinator.__init__ asserts it (one group: no finer hashing)
        raise _err(source, "config.hash_block_size",
                   f"one group with prefix caching needs h = its block size "
                   f"({groups[0].block_size}), got {h}")
    connector = doc.get("connector")
    if connector is not None:
        connector = _validate_connector(connector, source)
        _check_extension(connector, groups, bool(kw.get("use_eagle")), source)
    if "vllm" in doc:
        if doc["vllm"] not in RELEASES:
            raise _err(source, "config.vllm",
                       f"must be one of {', '.join(map(repr, RELEASES))} (the vLLM release "
                       f"whose semantics the trace expects), got {doc['vllm']!r}")
        kw["vllm"] = doc["vllm"]
    lookahead = doc.get("num_hash_lookahead_tokens", 0)
    if not _is_int(lookahead) or lookahead != 0:
        # VllmConfig.num_hash_lookahead_tokens: 0.34 turns it on under EAGLE with a connector
        # that answers supports_lookahead_block_hashes (Mooncake's store connector).
        raise _err(source, "config.num_hash_lookahead_tokens",
                   f"must be 0, got {lookahead!r}: hashing blocks past their end (EAGLE with "
                   "lookahead hashes) is not modelled")
    return TraceConfig(tuple(groups), h, nb, connector=connector, **kw)


def _retention(v: Any, groups: list[GroupConfig], source: str) -> int:
    """``prefix_cache_retention_interval``, checked as vLLM 0.33 checks it
    (``kv_cache_coordinator._validate_prefix_cache_retention_interval``)."""
    where = "config.prefix_cache_retention_interval"
    if not _is_int(v) or v < 0:
        raise _err(source, where, f"must be null or an int >= 0, got {v!r}")
    if v and not any(g.kind in ("mamba_align", "sliding_window") for g in groups):
        raise _err(source, where, "an interval > 0 needs a sliding-window or Mamba group")
    unit = lcm_all([g.block_size for g in groups])
    if v % unit:
        raise _err(source, where, f"must be a multiple of the scheduler block size ({unit}), "
                   f"got {v}")
    return v


def _check_extension(connector: dict[str, Any], groups: list[GroupConfig], use_eagle: bool,
                     source: str) -> None:
    """The reuse extension (turn-end and junction checkpoints) refuses speculative decoding
    and sliding windows (``docs/reuse.md``, "Limits"; impl's ``check_reuse_extension``): a
    step then does not end on a known boundary."""
    on = [k for k in ("turn_end_checkpoints", "decode_boundary_saves", "junction_checkpoints")
          if connector.get(k)]
    if not on:
        return
    where = f"config.connector.{on[0]}"
    if use_eagle or any(g.eagle for g in groups):
        raise _err(source, where, "the extension refuses EAGLE (speculative decoding)")
    if any(g.num_speculative_blocks for g in groups):
        raise _err(source, where, "the extension refuses Mamba speculative blocks")
    if any(g.kind == "sliding_window" for g in groups):
        raise _err(source, where, "the extension refuses sliding-window groups")


def _validate_connector(doc: Any, source: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise _err(source, "config.connector", "must be an object")
    try:
        return validate_connector_config(doc)
    except ValueError as e:
        raise _err(source, "config.connector", str(e)) from None


class OpReader:
    """Validates and normalises a trace's ops one at a time, in order, tracking the requests
    they name; the loader reads a whole trace with it, a lockstep run one op as it is written."""

    def __init__(self, source: str = "<trace>") -> None:
        self.source = source
        self.specs = opspec.all_op_specs()
        self.prompts: dict[str, list[int]] = {}  # expanded prompt of every request added
        self.live: set[str] = set()
        self.known: set[str] = set()

    def read(self, i: int, op: Any) -> dict[str, Any]:
        """The normalised op ``ops[i]`` (every field present, tokens expanded)."""
        source, where = self.source, f"ops[{i}]"
        if not isinstance(op, dict):
            raise _err(source, where, "must be an object")
        name = op.get("op")
        name = opspec.RENAMED_OPS.get(name, name) if isinstance(name, str) else name
        if not isinstance(name, str) or name not in self.specs:
            raise _err(source, f"{where}.op", f"unknown op {name!r}")
        spec = self.specs[name]
        extra = sorted(set(op) - set(spec) - {"op", "expect", "comment"})
        if extra:
            raise _err(source, f"{where}.{extra[0]}", f"unknown field for op {name!r}")
        norm: dict[str, Any] = {"op": name}
        for fname, f in spec.items():
            if fname not in op:
                if f.default is opspec.REQUIRED:
                    raise _err(source, f"{where}.{fname}", f"required by op {name!r}")
                norm[fname] = f.default
                continue
            norm[fname] = self._field(f"{where}.{fname}", f.kind, op[fname])
        self._track(where, norm)
        for key in ("expect", "comment"):
            if key in op:
                if key == "expect" and not isinstance(op[key], dict):
                    raise _err(source, f"{where}.expect", "must be an object")
                norm[key] = op[key]
        return norm

    def _field(self, where: str, kind: str, v: Any) -> Any:
        problem = opspec.field_problem(kind, v)
        if problem:
            raise _err(self.source, where, problem)
        if kind == opspec.RID and v not in self.known:
            raise _err(self.source, where, f"unknown request id {v!r}")
        if kind == opspec.TOKENS:
            try:
                return expand(v, self.prompts)
            except TokenError as e:
                raise _err(self.source, where, str(e)) from None
        return v

    def _track(self, where: str, norm: dict[str, Any]) -> None:
        name = norm["op"]
        if name == "add_request":
            rid = norm["rid"]
            if rid in self.live:
                raise _err(self.source, f"{where}.rid",
                           f"request {rid!r} is still live (free it first)")
            if not norm["tokens"]:
                raise _err(self.source, f"{where}.tokens", "a prompt needs at least one token")
            self.prompts[rid] = norm["tokens"]
            self.live.add(rid)
            self.known.add(rid)
        elif name == "free":
            self.live.discard(norm["rid"])
        if name == "evict" and (norm["blocks"] is None) == (norm["keys"] is None):
            raise _err(self.source, f"{where}.blocks", "evict takes exactly one of blocks or keys")


def parse_trace(doc: Any, source: str = "<trace>", protocol: bool = False) -> Trace:
    """Validate a decoded trace document and return it with normalised ops; ``protocol``
    adds the step protocol (docs/trace-format.md, "Step protocol"), which every trace the
    CLI reads (``load_trace``) and every trace ``shrink`` emits must pass."""
    if not isinstance(doc, dict):
        raise _err(source, "trace", "must be a JSON object")
    if doc.get("format") != FORMAT_TAG:
        raise _err(source, "format", f"expected {FORMAT_TAG!r}, got {doc.get('format')!r}")
    extra = sorted(set(doc) - {"format", "name", "description", "config", "ops", "notes",
                                "provenance"})
    if extra:
        raise _err(source, extra[0], "unknown top-level key")
    config = _parse_config(doc.get("config"), source)
    try:
        check_config(config)
    except CheckError as e:
        raise TraceError(f"{source}: {e}") from None
    ops_doc = doc.get("ops")
    if not isinstance(ops_doc, list):
        raise _err(source, "ops", "must be a list")
    reader = OpReader(source)
    out = [reader.read(i, op) for i, op in enumerate(ops_doc)]
    try:
        check_ops(out, config, protocol)
    except CheckError as e:
        raise TraceError(f"{source}: {e}") from None
    name = doc.get("name") or Path(source).stem
    return Trace(str(name), str(doc.get("description", "")), config, out, source, doc)


def load_trace(path: str | Path) -> Trace:
    """Read and validate one trace file."""
    p = Path(path)
    try:
        text = read_trace_bytes(p).decode("utf-8")
    except ReadRefused as e:
        raise TraceError(f"{p}: {e}") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text (byte {e.start}): a trace is a JSON file") \
            from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise TraceError(f"{p}: invalid JSON at {where}: {e.msg}") from None
    except RecursionError:
        raise TraceError(f"{p}: nested deeper than {limits.MAX_DEPTH} levels (the limit)") \
            from None
    except ValueError as e:  # an int literal longer than Python's digit limit
        raise TraceError(f"{p}: invalid JSON: {str(e).split(';')[0]}") from None
    problem = limits.depth_problem(doc)
    if problem:
        raise TraceError(f"{p}: {problem} (the limit)")
    return parse_trace(doc, str(p), protocol=True)
