"""vLLM detection without importing it (installed package vs source tree) and the range rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tailproof.conformance.harness import vllm_compat as vc


def test_source_tree_detected_with_its_version(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('detection must not import vllm')\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.34.0.dev7+gabc'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    info = vc.detect()
    assert (info.version, info.source) == ("0.34.0.dev7+gabc", "source tree")
    assert info.path == str(pkg.resolve())
    assert info.supported  # a source tree is judged by its API probes, not its number
    info.problems["vllm"] = ["KVCacheManager.allocate_slots: no parameter delay_cache_blocks"]
    reason = vc.refusal(info, "vllm")
    assert reason is not None and "source tree" in reason and "delay_cache_blocks" in reason


def test_installed_release_range() -> None:
    def info(v: str) -> vc.VllmInfo:
        return vc.VllmInfo(v, "installed package", "/x/vllm")

    assert info("0.33.0").supported and info("0.33.2").supported and info("0.34.0").supported
    assert not info("0.32.0").supported and not info("0.35.0").supported
    assert vc.refusal(info("0.33.1"), "vllm") is None
    assert vc.refusal(info("0.34.1"), "vllm") is None
    assert vc.refusal(info("0.33.1"), "reference") is None
    assert "outside the supported releases 0.33, 0.34" in (vc.refusal(info("0.31.0"), "impl")
                                                           or "")
    missing = vc.VllmInfo(None, "not installed", missing="torch")
    assert "needs torch" in (vc.refusal(missing, "vllm-mooncake") or "")


def test_releases_and_their_tables() -> None:
    assert [vc.release_of(v) for v in ("0.33.0", "0.34.2", "0.34.0.dev7+g1", "0.32.0",
                                       "0.35.0", "x")] == ["0.33", "0.34", "0.34", None,
                                                           None, None]
    assert [vc.nearest_release(v) for v in ("0.32.0", "0.35.1", None)] == ["0.33", "0.34",
                                                                            "0.34"]
    for r in vc.RELEASES:
        table = vc.release_probes(r)
        assert set(table) == set(vc.ADAPTER_PROBES)
        # each adapter's probes include those of the one below it
        assert set(table["vllm"]) <= set(table["vllm-mooncake"]) <= set(table["impl"])
    # the tables differ where the shapes do (layout.py, prefill_token_ids, ...)
    assert set(vc.release_probes("0.33")["impl"]) != set(vc.release_probes("0.34")["impl"])


def test_probes_pass_on_the_installed_release() -> None:
    """Whichever supported release this process imports (make test VLLM=0.33 for the other),
    its own table passes and the other release's does not."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    info = vc.inspect_vllm(all_releases=True)
    assert info.supported and info.source == "installed package", info
    assert info.release == vc.release_of(info.version or "")
    assert info.problems == {}
    assert info.release_problems[info.release] == {}
    for other in set(vc.RELEASES) - {info.release}:
        assert info.release_problems[other]["impl"], other
