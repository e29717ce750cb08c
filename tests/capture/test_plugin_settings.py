"""The recorder plugin's switches: environment and ``kv_connector_extra_config``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tailproof.conformance.capture.plugin import settings


def _cfg(extra: dict | None) -> SimpleNamespace:
    ktc = None if extra is None else SimpleNamespace(kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc)


def test_off_without_either_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILPROOF_RECORD", raising=False)
    assert settings(_cfg(None)) is None
    assert settings(_cfg({"store": "memory"})) is None


def test_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TAILPROOF_RECORD", f"{tmp_path}/x-{{pid}}.json")
    monkeypatch.setenv("TAILPROOF_RECORD_REDACT", "1")
    monkeypatch.setenv("TAILPROOF_RECORD_MAX_BYTES", "1000")
    s = settings(_cfg(None))
    assert s is not None and s["redact"] and s["max_bytes"] == 1000
    assert "{pid}" not in s["path"] and s["path"].startswith(f"{tmp_path}/x-")


def test_extra_config_wins_and_is_checked(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    env, kv, p = (str(tmp_path / n) for n in ("env.json", "kv.json", "p.json"))
    monkeypatch.setenv("TAILPROOF_RECORD", env)
    s = settings(_cfg({"tailproof_record": {"path": kv, "redact": True}}))
    assert s == {"path": kv, "redact": True, "max_bytes": None}
    assert settings(_cfg({"tailproof_record": p}))["path"] == p
    with pytest.raises(ValueError, match="tailproof_record.rotate: unknown key"):
        settings(_cfg({"tailproof_record": {"path": p, "rotate": 1}}))


def test_tailproof_connector_accepts_the_key(tmp_path: Path) -> None:
    from tailproof.impl.config import parse_settings

    parse_settings({"store": "memory", "tailproof_record": str(tmp_path / "x.json")}, "kv_both")
