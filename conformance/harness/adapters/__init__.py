"""Adapter registry: each name pairs a core backend with an optional connector.

Entries are import paths so that naming an adapter imports only what it needs (vLLM is
imported only by the adapters that run it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from tailproof.conformance.format.connector_config import extension_refusal
from tailproof.conformance.format.trace import TraceConfig
from tailproof.conformance.harness.driver import CoreDriver

_REF_CORE = "tailproof.conformance.harness.adapters.reference_core:ReferenceCoreBackend"
_VLLM_CORE = "tailproof.conformance.harness.adapters.vllm_core:VllmCoreBackend"


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    core: str
    connector: str | None
    summary: str
    takes_options: bool = False  # whether make_driver's ``options`` reach its connector
    # whether it runs the turn-end checkpoint extension (docs/reuse.md); vLLM 0.33 does not
    runs_extension: bool = True
    # Without a connector: why it runs none of the connector ops (replays observe nothing of
    # them on this adapter and list them as unsupported).
    refuses_connector_ops: str = ""


ADAPTERS: dict[str, AdapterSpec] = {a.name: a for a in [
    AdapterSpec("reference", _REF_CORE,
                "tailproof.conformance.harness.adapters.reference_connector:ReferenceConnector",
                "pure-Python reference model (core + connector)"),
    AdapterSpec("vllm", _VLLM_CORE, None, "vLLM KVCacheManager, 0.33 or 0.34 (core ops only)",
                runs_extension=False,
                refuses_connector_ops="vLLM's KVCacheManager alone: no KV connector to run "
                                      "them on (vllm-mooncake adds vLLM's own)"),
    AdapterSpec("vllm-mooncake", _VLLM_CORE,
                "tailproof.conformance.harness.adapters.vllm_mooncake:VllmMooncakeConnector",
                "vLLM KVCacheManager + MooncakeStoreScheduler + sending thread",
                runs_extension=False),
    AdapterSpec("impl", _VLLM_CORE, "tailproof.conformance.harness.adapters.impl:ImplConnector",
                "vLLM KVCacheManager + TailproofConnector with real KV tensors",
                takes_options=True),
]}


class AdapterUnavailable(RuntimeError):
    """An adapter whose dependencies (vLLM, torch) are not installed here."""


class AdapterRefused(ValueError):
    """A trace the adapter cannot run faithfully (its config turns on a rule the adapter's
    engine does not have); the message says why. Replays skip the adapter for that trace."""


def refusal(name: str, config: TraceConfig) -> str | None:
    """Why adapter ``name`` refuses a trace of ``config`` (None: it runs it). The vLLM
    adapters refuse the turn-end checkpoint extension (``docs/reuse.md``) rather than run
    the trace without it. Every adapter refuses sparse state retention: it replays with dense
    retention, which offers boundaries the engine did not keep."""
    if config.sparse_retention:
        return (f"{name}: config.prefix_cache_retention_interval="
                f"{config.prefix_cache_retention_interval}: sparse Mamba / sliding-window "
                "retention (vLLM 0.33 reachable_block_mask) is not modelled; the adapters keep "
                "states densely (record with the interval None)")
    if ADAPTERS[name].runs_extension:
        return None
    why = extension_refusal(config)
    return f"{name}: {why}" if why else None


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise AdapterUnavailable(f"{path}: {e}") from e


def make_driver(name: str, config: TraceConfig,
                options: dict[str, Any] | None = None) -> CoreDriver:
    """A fresh driver for one trace on the named adapter. ``options`` configure its connector:
    the ``impl`` adapter takes ``store`` (memory | mooncake), ``store_config`` and ``device``;
    the others take none."""
    if name not in ADAPTERS:
        raise KeyError(f"unknown adapter {name!r}; known: {', '.join(ADAPTERS)}")
    spec = ADAPTERS[name]
    if options and not spec.takes_options:
        raise ValueError(f"adapter {name!r} takes no options, got {sorted(options)}")
    why = refusal(name, config)
    if why is not None:
        raise AdapterRefused(why)
    core = _load(spec.core)(config)
    connector = None
    if spec.connector is not None:
        cls = _load(spec.connector)
        connector = cls(config, core, options) if spec.takes_options else cls(config, core)
    return CoreDriver(config, core, connector)


def available(name: str) -> bool:
    """Whether the adapter's dependencies import here."""
    spec = ADAPTERS[name]
    try:
        _load(spec.core)
        if spec.connector:
            _load(spec.connector)
    except AdapterUnavailable:
        return False
    return True
