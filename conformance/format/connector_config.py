"""The ``config.connector`` section of trace format v1: its keys, their types and defaults,
and whether it turns on the reuse extension (which vLLM 0.33's connectors do not have).

See ``docs/connector-ops.md`` ("The connector section") and ``docs/reuse.md``.
"""

from __future__ import annotations

from typing import Any

_CONFIG_FIELDS: dict[str, tuple[type, Any]] = {
    "role": (str, "producer"),
    "num_workers": (int, 1),
    "save_decode_cache": (bool, False),
    "enable_lookup": (bool, True),
    "load_async": (bool, False),
}

# The turn-end checkpoint extension (``docs/reuse.md``; not in vLLM 0.33). Written out only when
# given, so a config without them (every vLLM-recorded case, every capture) stays as it is.
EXTENSION_FIELDS: dict[str, tuple[type, Any]] = {
    "turn_end_checkpoints": (bool, False),
    "checkpoint_slots": (int, 32),
    "checkpoint_reserve_blocks": (int, 4),
    "decode_boundary_saves": (bool, False),
    # rule 7 (impl's lookup wait): off in traces unless given (impl's own default is on)
    "checkpoint_lookup_wait": (bool, False),
    # junction checkpoints (docs/junctions.md, "The extension")
    "junction_checkpoints": (bool, False),
    "junction_index_blocks": (int, 1 << 18),
    # with junction_checkpoints: the hook also sets the manager's junction keying
    "device_junctions": (bool, False),
    # tailproof's pin rules (reference/connector/scheduler.py, DEVIATIONS; not vLLM 0.33): off
    # in traces unless given (impl's own defaults are on: true, 0.25)
    "readable_pins": (bool, False),
    "pin_budget_fraction": (float, None),
}
JUNCTION_INDEX_MAX = 1 << 24


def _typed(key: str, v: Any, typ: type) -> Any:
    if not (isinstance(v, typ) and (typ is not int or not isinstance(v, bool))):
        raise ValueError(f"{key} must be a {typ.__name__}, got {v!r}")
    return v


def validate_connector_config(doc: dict[str, Any]) -> dict[str, Any]:
    """Normalise ``config.connector``: known keys only, typed, with defaults filled in (the
    extension's keys only when given)."""
    unknown = sorted(set(doc) - set(_CONFIG_FIELDS) - set(EXTENSION_FIELDS))
    if unknown:
        raise ValueError(f"unknown connector key {unknown[0]!r}")
    out: dict[str, Any] = {}
    for key, (typ, default) in _CONFIG_FIELDS.items():
        out[key] = _typed(key, doc.get(key, default), typ)
    for key, (typ, _) in EXTENSION_FIELDS.items():
        if key in doc:
            out[key] = _typed(key, doc[key], typ)
    if out.get("checkpoint_slots", 1) < 1:
        raise ValueError(f"checkpoint_slots must be >= 1, got {out['checkpoint_slots']}")
    if out.get("checkpoint_reserve_blocks", 0) < 0:
        raise ValueError("checkpoint_reserve_blocks must be >= 0, "
                         f"got {out['checkpoint_reserve_blocks']}")
    if not 1 <= out.get("junction_index_blocks", 1) <= JUNCTION_INDEX_MAX:
        raise ValueError(f"junction_index_blocks must be in 1..{JUNCTION_INDEX_MAX}, "
                         f"got {out['junction_index_blocks']}")
    frac = out.get("pin_budget_fraction")
    if frac is not None and not 0 < frac <= 1:
        raise ValueError(f"pin_budget_fraction must be in (0, 1], got {frac}")
    if out["role"] not in ("producer", "consumer", "both"):
        raise ValueError(f"role must be producer, consumer or both, got {out['role']!r}")
    if not 1 <= out["num_workers"] <= 8:
        raise ValueError(f"num_workers must be in 1..8, got {out['num_workers']}")
    return out


_EXTENSION_SWITCHES = {
    "turn_end_checkpoints": "the turn-end checkpoint extension (docs/reuse.md)",
    "decode_boundary_saves": "the turn-end checkpoint extension (docs/reuse.md)",
    "junction_checkpoints": "the junction checkpoint extension (docs/junctions.md)",
}


def extension_on(conf: dict[str, Any] | None) -> bool:
    """Whether a (normalised) connector section turns on a rule of the reuse extension
    (turn-end checkpoints, ``docs/reuse.md``; junction checkpoints, ``docs/junctions.md``),
    which vLLM 0.33's connectors do not have."""
    return bool(conf) and any(conf.get(k) for k in _EXTENSION_SWITCHES)


#: connector keys of tailproof's own pin rules, which vLLM 0.33's connector does not have
DEVIATION_SWITCHES = {
    "readable_pins": "tailproof's readable-pins rule (reference/connector/scheduler.py)",
    "pin_budget_fraction": "tailproof's pin budget (reference/connector/scheduler.py)",
}


def extension_refusal(config: Any) -> str | None:
    """Why a vLLM adapter cannot run a trace: its connector section turns on the extension or
    one of tailproof's pin rules (running it would silently ignore the setting). None when it
    can."""
    conf = getattr(config, "connector", None)
    for key, what in DEVIATION_SWITCHES.items():
        if conf and conf.get(key) not in (None, False):
            return (f"config.connector.{key} is set: {what} is not in vLLM 0.33 or 0.34; only "
                    "reference and impl run it")
    if not extension_on(conf):
        return None
    on = [k for k in _EXTENSION_SWITCHES if conf.get(k)]
    return (f"config.connector.{on[0]} is on: {_EXTENSION_SWITCHES[on[0]]} "
            f"is not in vLLM 0.33 or 0.34; only reference and impl run it")


def connector_config(config: Any) -> dict[str, Any]:
    """The normalised connector section of a ``TraceConfig`` (defaults when absent)."""
    return validate_connector_config(dict(getattr(config, "connector", None) or {}))
