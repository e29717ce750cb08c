"""The ``impl`` adapter (TailproofConnector + vLLM's KVCacheManager + real KV tensors) agrees
with the reference on the whole corpus, and its byte checks catch data-path bugs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tailproof.conformance.format.trace import load_trace  # noqa: E402
from tailproof.conformance.harness.adapters import impl as impl_adapter  # noqa: E402
from tailproof.conformance.harness.adapters import make_driver  # noqa: E402
from tailproof.conformance.harness.replay import run_trace  # noqa: E402

pytestmark = pytest.mark.vllm

CASES = sorted((Path(__file__).parents[2] / "conformance" / "cases").glob("*.json"))
CONN_CASES = [p for p in CASES if p.name.startswith("conn_")]


@pytest.fixture
def store_env(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The impl adapter's options for the store named by ``request.param`` (memory or
    mooncake)."""
    kind = getattr(request, "param", "memory")
    options: dict[str, Any] = {"store": kind}
    if kind == "mooncake":
        options["store_config"] = {"master_address": request.getfixturevalue("mooncake_master")}
    yield options
    impl_adapter.close_shared_stores()


def _divergences(paths: list[Path], options: dict[str, Any]) -> list[str]:
    out = []
    for p in paths:
        res = run_trace(load_trace(p), ["reference", "impl"], options={"impl": options})
        out += [f"{d.case}@{d.op_index} {d.op} vs {d.against}: {d.got}" for d in res.divergences]
    return out


@pytest.mark.parametrize("store_env", ["memory"], indirect=True)
def test_corpus_agrees_with_reference(store_env: dict[str, Any]) -> None:
    assert CASES, "no conformance cases found"
    assert _divergences(CASES, store_env) == []


@pytest.mark.mooncake
@pytest.mark.parametrize("store_env", ["mooncake"], indirect=True)
def test_connector_corpus_agrees_on_mooncake(store_env: dict[str, Any]) -> None:
    assert _divergences(CONN_CASES, store_env) == []


def _puts_tail(p: Path) -> bool:
    return "tail" in p.name or "cow" in p.name or "handoff" in p.name


@pytest.mark.parametrize("store_env", ["memory"], indirect=True)
def test_byte_check_catches_skipped_cow_copy(store_env: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """If the CoW copy did not run, the store job would read the target's stale bytes."""
    monkeypatch.setattr(impl_adapter.ImplConnector, "copies", lambda self, pairs: None)
    divs = _divergences([p for p in CONN_CASES if _puts_tail(p)], store_env)
    assert any("KVByteMismatch" in d for d in divs), divs


@pytest.mark.parametrize("store_env", ["memory"], indirect=True)
def test_byte_check_catches_wrong_block(store_env: dict[str, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the neighbouring block (a wrong offset) is caught at put time."""
    from tailproof.impl.kv_layout import KVLayout

    orig = KVLayout.read_block
    monkeypatch.setattr(KVLayout, "read_block",
                        lambda self, g, b, out: orig(self, g, (b % (self.num_blocks - 1)) + 1,
                                                     out))
    divs = _divergences(CONN_CASES[:10], store_env)
    assert any("KVByteMismatch" in d for d in divs), divs


def test_options_reach_only_the_impl_adapter() -> None:
    """``make_driver`` options select the impl adapter's store; other adapters refuse them."""
    config = load_trace(CONN_CASES[0]).config
    driver = make_driver("impl", config, {"store": "memory", "device": "cpu"})
    assert driver.connector is not None and driver.connector.settings.store == "memory"
    with pytest.raises(ValueError, match="takes no options"):
        make_driver("reference", config, {"store": "memory"})
    res = run_trace(load_trace(CONN_CASES[0]), ["reference", "impl"],
                    options={"impl": {"store": "memory"}})
    assert res.divergences == []
