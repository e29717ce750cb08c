"""The trace's ``config.connector`` read from a live engine's KV connector configuration.

Mirrors how vLLM 0.33's ``MooncakeStoreScheduler.__init__`` (``mooncake/store/scheduler.py``)
reads ``kv_connector_extra_config`` (``TailproofConnector`` reads the same keys, same defaults),
and the rank count ``parallel_config.world_size`` (one store worker per rank).
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.connector_config import (
    DEVIATION_SWITCHES,
    EXTENSION_FIELDS,
    extension_on,
    validate_connector_config,
)
from tailproof.impl.config import Settings

# Connectors whose scheduler-side semantics the connector ops model (docs/connector-ops.md).
MODELLED_CONNECTORS = ("MooncakeStoreConnector", "TailproofConnector")
_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


class ConnectorConfigError(ValueError):
    """An engine connector configuration the trace's ``config.connector`` cannot express."""


def connector_config(vllm_config: Any, connector: Any = None) -> dict[str, Any] | None:
    """``config.connector`` for ``vllm_config`` (None without a KV connector). ``connector``:
    the engine's scheduler-side connector, whose settings settle an extension part given as
    ``"auto"`` (the trace records what the engine ran).

    Raises ``ConnectorConfigError`` naming the field for a connector the connector ops do not
    model, an unknown role, or more ranks than the trace format allows."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or ktc.kv_connector is None:
        return None
    if ktc.kv_connector not in MODELLED_CONNECTORS:
        raise ConnectorConfigError(
            f"kv_transfer_config.kv_connector: {ktc.kv_connector!r} is not modelled by the "
            f"connector ops (modelled: {', '.join(MODELLED_CONNECTORS)})")
    role = _ROLES.get(ktc.kv_role)
    if role is None:
        raise ConnectorConfigError(f"kv_transfer_config.kv_role: {ktc.kv_role!r} is not one of "
                                   f"{', '.join(_ROLES)}")
    extra = dict(ktc.kv_connector_extra_config or {})
    cfg = {
        "role": role,
        "num_workers": int(vllm_config.parallel_config.world_size),
        "save_decode_cache": bool(extra.get("save_decode_cache", False)),
        "enable_lookup": bool(extra.get("enable_lookup", True)),
        "load_async": bool(extra.get("load_async", True)),
    }
    if ktc.kv_connector == "TailproofConnector":
        # The turn-end checkpoint extension (docs/reuse.md): its keys only when given, so a
        # trace of an engine with them on replays them (and the vLLM adapters refuse it).
        cfg.update({k: extra[k] for k in EXTENSION_FIELDS if k in extra})
        for key in [k for k, v in cfg.items() if v == "auto"]:
            ran = getattr(getattr(connector, "settings", None), key, None)
            if not isinstance(ran, bool):
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.{key}: \"auto\" is settled by the engine's "
                    "connector, which the recorder could not read")
            cfg[key] = ran
        if extension_on(cfg):  # the connector's own default (Settings), not the traces'
            cfg.setdefault("checkpoint_lookup_wait", True)
        # tailproof's pin rules: what the engine ran (Settings' defaults when not given),
        # written only when on (off is a trace's default: vLLM 0.33's rule)
        ran = getattr(connector, "settings", None)
        for key in DEVIATION_SWITCHES:
            val = extra[key] if key in extra else getattr(ran or Settings(), key)
            if val is None or val is False:
                cfg.pop(key, None)
            else:
                cfg[key] = float(val) if key == "pin_budget_fraction" else val
    try:
        return validate_connector_config(cfg)
    except ValueError as e:
        raise ConnectorConfigError(f"config.connector: {e}") from None
