"""A trace's ``config`` section, declared once: one table of its keys (:data:`CONFIG_KEYS`) and
one of a group's (:data:`GROUP_KEYS`). Each key carries its JSON Schema (the generated
``trace.schema.json`` takes it from here) and the check that names it in a one-line error
(``config.hash_block_size: must be an int > 0, got 0``); the rules between keys (h divides
every block size, one group needs h = its block size, the extension's refusals) follow in
:func:`parse_config`. Nothing else lists the keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailproof.conformance.format.connector_config import validate_connector_config
from tailproof.reference.geometry import KINDS, Geometry, GroupSpec
from tailproof.reference.releases import RELEASES
from tailproof.spec.arithmetic import lcm_all

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


Check = Callable[[Any], str | None]


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be a bool"


def _int_at_least(low: int, said: str) -> Check:
    def check(v: Any) -> str | None:
        return None if _is_int(v) and v >= low else f"must be an int {said}, got {v!r}"
    return check


def _release(v: Any) -> str | None:
    if v in RELEASES:
        return None
    return (f"must be one of {', '.join(map(repr, RELEASES))} (the vLLM release whose semantics "
            f"the trace expects), got {v!r}")


def _no_lookahead(v: Any) -> str | None:
    # VllmConfig.num_hash_lookahead_tokens: 0.34 turns it on under EAGLE with a connector that
    # answers supports_lookahead_block_hashes (Mooncake's store connector).
    if _is_int(v) and v == 0:
        return None
    return (f"must be 0, got {v!r}: hashing blocks past their end (EAGLE with lookahead "
            "hashes) is not modelled")


def _retention_value(v: Any) -> str | None:
    return None if v is None or (_is_int(v) and v >= 0) else \
        f"must be null or an int >= 0, got {v!r}"


@dataclass(frozen=True)
class Key:
    """One config key: its JSON Schema, its check (a problem, or None; None: checked by its
    owner, as ``groups`` and ``connector`` are) and whether it must be given. ``kw``: the
    ``TraceConfig`` field it sets (None: the key's own name, False: set by its owner)."""

    schema: dict[str, Any]
    check: Check | None = None
    required: bool = False
    kw: str | bool | None = None


_NAT: dict[str, Any] = {"type": "integer", "minimum": 0}

#: The keys of one group (``config.groups[i]``); the rules between them in ``_parse_group``.
GROUP_KEYS: dict[str, Key] = {
    "kind": Key({"enum": list(GROUP_KINDS)}, required=True),
    "block_size": Key({"type": "integer", "minimum": 1}, _int_at_least(1, "> 0"),
                      required=True),
    "eagle": Key({"type": "boolean"}, _bool),
    "mamba_cache_mode": Key({"const": "align"}),
    "sliding_window": Key({"type": "integer", "minimum": 1, "description": (
        "window in tokens; required for (and only for) a sliding_window group")}),
    "num_speculative_blocks": Key({**_NAT, "description": (
        "MambaSpec.num_speculative_blocks (Mamba groups only; > 0 not with a connector)")},
        _int_at_least(0, ">= 0")),
}

#: The keys of ``config``, in the order they are checked.
CONFIG_KEYS: dict[str, Key] = {
    "groups": Key({"type": "array", "minItems": 1, "items": {
        "type": "object", "required": [k for k, v in GROUP_KEYS.items() if v.required],
        "additionalProperties": False,
        "properties": {k: v.schema for k, v in GROUP_KEYS.items()}}},
        required=True, kw=False),
    "hash_block_size": Key({"type": "integer", "minimum": 1, "description": (
        "h; must divide every group's block_size")}, _int_at_least(1, "> 0"), required=True,
        kw=False),
    "num_blocks": Key({"type": "integer", "minimum": 2}, _int_at_least(2, ">= 2"),
                      required=True, kw=False),
    "enable_caching": Key({"type": "boolean"}, _bool),
    "use_eagle": Key({"type": "boolean"}, _bool),
    "enable_mamba_shared_prefix_checkpoint": Key({"type": "boolean", "description": (
        "CacheConfig.enable_mamba_shared_prefix_checkpoint; takes effect with an EAGLE group "
        "and partial hits")}, _bool),
    "max_model_len": Key(_NAT, _int_at_least(0, ">= 0")),
    "max_num_scheduled_tokens": Key(_NAT, _int_at_least(0, ">= 0")),
    "long_prefill_token_threshold": Key(_NAT, _int_at_least(0, ">= 0")),
    "connector": Key({"type": "object"}, kw=False),
    "split_block_size": Key({"type": "integer", "minimum": 1, "description": (
        "cache_config.block_size of the scheduler split; a group block size")}, kw=False),
    "prefix_cache_retention_interval": Key({"type": ["integer", "null"], "minimum": 0,
                                            "description": (
        "KVCacheConfig.prefix_cache_retention_interval; null/absent = dense Mamba and "
        "sliding-window retention; 0 or an interval (sparse) makes every adapter refuse the "
        "trace")}, _retention_value, kw=False),
    "vllm": Key({"enum": list(RELEASES), "description": (
        "the vLLM release whose semantics the trace expects (docs/releases.md); absent = "
        "0.33")}, _release),
    "num_hash_lookahead_tokens": Key({"const": 0, "description": (
        "VllmConfig.num_hash_lookahead_tokens as the engine resolved it; hash lookahead is not "
        "modelled, so only 0 (the default) is accepted")}, _no_lookahead, kw=False),
}


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the ``config`` section, from :data:`CONFIG_KEYS`."""
    return {"type": "object", "required": [k for k, v in CONFIG_KEYS.items() if v.required],
            "additionalProperties": False,
            "properties": {k: v.schema for k, v in CONFIG_KEYS.items()}}


def _err(source: str, where: str, msg: str) -> TraceError:
    return TraceError(f"{source}: {where}: {msg}")


def _parse_group(g: Any, where: str, seen_mamba: bool, source: str) -> GroupConfig:
    """One group: its keys (``GROUP_KEYS``), then the rules between them."""
    if not isinstance(g, dict):
        raise _err(source, where, "must be an object")
    extra = sorted(set(g) - set(GROUP_KEYS))
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
    for name, absent in (("block_size", None), ("eagle", False)):
        check = GROUP_KEYS[name].check
        if check is not None and (problem := check(g.get(name, absent))):
            raise _err(source, f"{where}.{name}", problem)
    window = g.get("sliding_window")
    if kind == "sliding_window":
        if not _is_int(window) or window <= 0:
            raise _err(source, f"{where}.sliding_window",
                       f"must be an int > 0 for a sliding_window group, got {window!r}")
    elif window is not None:
        raise _err(source, f"{where}.sliding_window", "only sliding_window groups have one")
    spec_blocks = g.get("num_speculative_blocks", 0)
    check = GROUP_KEYS["num_speculative_blocks"].check
    if check is not None and (problem := check(spec_blocks)):
        raise _err(source, f"{where}.num_speculative_blocks", problem)
    if spec_blocks and kind != "mamba_align":
        raise _err(source, f"{where}.num_speculative_blocks", "only Mamba groups have them")
    return GroupConfig(kind, g["block_size"], g.get("eagle", False), window, spec_blocks)


def _parse_groups(v: Any, source: str) -> list[GroupConfig]:
    if not isinstance(v, list) or not v:
        raise _err(source, "config.groups", "must be a non-empty list")
    groups: list[GroupConfig] = []
    for i, g in enumerate(v):
        groups.append(_parse_group(g, f"config.groups[{i}]", any(
            x.kind == "mamba_align" for x in groups), source))
    return groups


def parse_config(doc: Any, source: str) -> TraceConfig:
    """The trace's ``config``: every key checked by its declaration, in :data:`CONFIG_KEYS`'
    order (the first problem is the error), then the rules between keys."""
    if not isinstance(doc, dict):
        raise _err(source, "config", "must be an object")
    unknown = sorted(set(doc) - set(CONFIG_KEYS))
    if unknown:
        raise _err(source, f"config.{unknown[0]}", "unknown config key")
    groups = _parse_groups(doc.get("groups"), source)
    kw: dict[str, Any] = {}
    for name, key in CONFIG_KEYS.items():
        if key.check is None or (name not in doc and not key.required):
            continue
        problem = key.check(doc.get(name))
        if problem:
            raise _err(source, f"config.{name}", problem)
        if key.kw is not False:
            kw[key.kw or name] = doc[name]
        if name == "hash_block_size":  # h divides every block size (before the pool size)
            _check_h_divides(doc[name], groups, source)
    h, nb = doc["hash_block_size"], doc["num_blocks"]
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
    return TraceConfig(tuple(groups), h, nb, connector=connector, **kw)


def _check_h_divides(h: int, groups: list[GroupConfig], source: str) -> None:
    for i, g in enumerate(groups):
        if g.block_size % h:
            raise _err(source, "config.hash_block_size",
                       f"h={h} does not divide groups[{i}].block_size={g.block_size}")


def _retention(v: int, groups: list[GroupConfig], source: str) -> int:
    """``prefix_cache_retention_interval`` (its value checked by its key), checked as vLLM 0.33
    checks it (``kv_cache_coordinator._validate_prefix_cache_retention_interval``)."""
    where = "config.prefix_cache_retention_interval"
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
