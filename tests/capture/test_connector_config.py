"""The trace's ``config.connector`` derived from an engine's KV connector configuration, and
what a recorder attached to an engine with a connector says it leaves out."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tailproof.conformance.capture.connector_config import (
    ConnectorConfigError,
    connector_config,
)
from tailproof.conformance.format.connector_config import validate_connector_config


def _vllm_config(connector: str | None = "TailproofConnector", role: str = "kv_both",
                 extra: dict[str, Any] | None = None, world_size: int = 1) -> Any:
    ktc = None if connector is None else SimpleNamespace(
        kv_connector=connector, kv_role=role, kv_connector_extra_config=extra or {})
    return SimpleNamespace(kv_transfer_config=ktc,
                           parallel_config=SimpleNamespace(world_size=world_size))


def test_no_connector_gives_none() -> None:
    assert connector_config(_vllm_config(None)) is None


@pytest.mark.parametrize("name", ["TailproofConnector", "MooncakeStoreConnector"])
def test_engine_defaults(name: str) -> None:
    # MooncakeStoreScheduler.__init__: load_async True, enable_lookup True, no decode saves.
    cfg = connector_config(_vllm_config(name))
    pins = ({"readable_pins": True, "pin_budget_fraction": 0.25}
            if name == "TailproofConnector" else {})  # tailproof's pin rules: what ran
    assert cfg == {"role": "both", "num_workers": 1, "save_decode_cache": False,
                   "enable_lookup": True, "load_async": True, **pins}
    assert validate_connector_config(cfg) == cfg


def test_tailproof_pin_rules_as_given() -> None:
    cfg = connector_config(_vllm_config(
        extra={"readable_pins": False, "pin_budget_fraction": None}))
    assert "pin_budget_fraction" not in cfg and "readable_pins" not in cfg
    cfg = connector_config(_vllm_config(extra={"pin_budget_fraction": 1}))
    assert cfg["pin_budget_fraction"] == 1.0 and cfg["readable_pins"] is True


def test_roles_ranks_and_extra_keys_follow_the_engine() -> None:
    cfg = connector_config(_vllm_config(
        role="kv_consumer", world_size=2,
        extra={"save_decode_cache": True, "enable_lookup": False, "load_async": False,
               "store": "memory"}))
    assert cfg == {"role": "consumer", "num_workers": 2, "save_decode_cache": True,
                   "enable_lookup": False, "load_async": False, "readable_pins": True,
                   "pin_budget_fraction": 0.25}
    assert connector_config(_vllm_config(role="kv_producer"))["role"] == "producer"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"connector": "NixlConnector"}, "kv_transfer_config.kv_connector"),
    ({"role": "kv_sideways"}, "kv_transfer_config.kv_role"),
    ({"world_size": 9}, "config.connector: num_workers"),
])
def test_unexpressible_configs_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConnectorConfigError, match=field.replace(".", r"\.")):
        connector_config(_vllm_config(**kwargs))


@pytest.mark.vllm
def test_recorder_on_a_connector_engine_names_what_it_leaves_out(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from tailproof.conformance.capture.recorder import Recorder
    from tailproof.conformance.tools.capture_engine.engine import CaptureEngine

    engine = CaptureEngine(num_blocks=64, kv_transfer={
        "kv_connector": "TailproofConnector",
        "kv_connector_module_path": "tailproof.impl.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory"}})
    try:
        assert type(engine.sched.connector).__name__ == "TailproofConnector"
        out = tmp_path / "t.json"
        rec = Recorder.attach(engine.sched, out)
        rec.close()
    finally:
        engine.shutdown()
    doc = json.loads(out.read_text())
    assert doc["provenance"]["connector"] == "TailproofConnector"
    assert doc["provenance"]["connector_config"] == {
        "role": "both", "num_workers": 1, "save_decode_cache": False, "enable_lookup": True,
        "load_async": True, "readable_pins": True, "pin_budget_fraction": 0.25}
    assert rec.unmodelled == {
        "KV connector calls and worker outcomes (TailproofConnector): not recorded": 1}
