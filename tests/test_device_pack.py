"""The GPU check's pack tool (scripts/devpack.py): the size limit, the manifest's own figures,
what a vLLM tarball holds, and the digests that tell a stale pack from a current one."""

from __future__ import annotations

import importlib.util
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "devpack.py"


@pytest.fixture(scope="module")
def devpack() -> ModuleType:
    spec = importlib.util.spec_from_file_location("devpack", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_site(root: Path, version: str = "9.9.0") -> Path:
    """An installed vLLM as pip leaves it: sources, a compiled op, headers, bytecode."""
    files = {
        "vllm/__init__.py": "x = 1\n", "vllm/sub/mod.py": "y = 2\n",
        "vllm/sub/conf.json": "{}", "vllm/tmpl.jinja": "{{ a }}", "vllm/py.typed": "",
        "vllm/_C.abi3.so": "\x7fELF", "vllm/include/k.hpp": "int k;",
        "vllm/vllm-rs": "\x7fELF", "vllm/__pycache__/mod.cpython-311.pyc": "pyc",
        f"vllm-{version}.dist-info/METADATA": f"Name: vllm\nVersion: {version}\n",
        f"vllm-{version}.dist-info/entry_points.txt": "[console_scripts]\n",
        f"vllm-{version}.dist-info/RECORD": "vllm/__init__.py,sha256=a,6\n",
        f"vllm-{version}.dist-info/INSTALLER": "pip\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_vllm_tarball_holds_sources_and_metadata_only_and_is_reproducible(
        devpack: ModuleType, tmp_path: Path) -> None:
    site = fake_site(tmp_path / "site")
    a, b = tmp_path / "a.tar.xz", tmp_path / "b.tar.xz"
    devpack.vllm_tar(site, "9.9.0", a, None)
    devpack.vllm_tar(site, "9.9.0", b, None)
    assert a.read_bytes() == b.read_bytes()
    with tarfile.open(a) as t:
        names = sorted(t.getnames())
    assert names == ["vllm-9.9.0.dist-info/METADATA", "vllm-9.9.0.dist-info/entry_points.txt",
                     "vllm/__init__.py", "vllm/py.typed", "vllm/sub/conf.json",
                     "vllm/sub/mod.py", "vllm/tmpl.jinja"]
    out = tmp_path / "unpacked"
    assert devpack.unpack(a, out) == 0
    assert (out / "vllm/sub/mod.py").read_text() == "y = 2\n"
    with pytest.raises(SystemExit, match="no vllm 9.8.0"):
        devpack.vllm_tar(site, "9.8.0", tmp_path / "c.tar.xz", None)


def test_manifest_states_its_true_size_and_fails_over_the_limit(
        devpack: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pack = tmp_path / "pack"
    (pack / "wheels").mkdir(parents=True)
    (pack / "wheels" / "w.whl").write_bytes(b"w" * 300_000)
    (pack / "v.tar.xz").write_bytes(b"v" * 200_000)
    assert devpack.write_manifest(pack, 1, ["commit=abc", "vllm releases=9.9.0"]) == 0
    total = sum(p.stat().st_size for p in pack.rglob("*") if p.is_file())
    assert devpack.manifest_value(pack, "size").startswith(f"{total} bytes")
    assert devpack.manifest_value(pack, "vllm releases") == "9.9.0"
    assert devpack.verify(pack) == 0
    assert devpack.write_manifest(pack, 0.4, []) == 1
    assert "over its 0.4 MiB limit" in capsys.readouterr().err


def test_verify_names_a_changed_or_missing_file(devpack: ModuleType, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "a.whl").write_bytes(b"a")
    (pack / "b.whl").write_bytes(b"b")
    devpack.write_manifest(pack, 1, [])
    (pack / "a.whl").write_bytes(b"A")
    (pack / "b.whl").unlink()
    capsys.readouterr()
    assert devpack.verify(pack) == 1
    assert "2 file(s) of the pack missing or changed: a.whl, b.whl" in capsys.readouterr().out
    assert devpack.verify(tmp_path / "none") == 1


def test_source_digest_follows_the_package_sources_only(devpack: ModuleType,
                                                        tmp_path: Path) -> None:
    (tmp_path / "impl" / "__pycache__").mkdir(parents=True)
    (tmp_path / "impl" / "m.py").write_text("a = 1\n")
    (tmp_path / "tests").mkdir()
    first = devpack.source_digest(tmp_path)
    (tmp_path / "impl" / "__pycache__" / "m.pyc").write_text("x")
    (tmp_path / "tests" / "t.py").write_text("x")
    assert devpack.source_digest(tmp_path) == first
    (tmp_path / "impl" / "m.py").write_text("a = 2\n")
    assert devpack.source_digest(tmp_path) != first


def test_an_earlier_tarball_is_reused_only_for_the_same_record(devpack: ModuleType,
                                                               tmp_path: Path) -> None:
    site = fake_site(tmp_path / "site")
    old = tmp_path / "old"
    old.mkdir()
    devpack.vllm_tar(site, "9.9.0", old / "vllm-9.9.0.tar.xz", None)
    devpack.write_manifest(old, 1, [f"vllm 9.9.0={devpack.vllm_digest(site, '9.9.0')}"])
    (old / "vllm-9.9.0.tar.xz").write_bytes(b"kept")  # a reused tarball is copied as it is
    (tmp_path / "new").mkdir()
    new = tmp_path / "new" / "vllm-9.9.0.tar.xz"  # the same name as in the earlier pack
    devpack.vllm_tar(site, "9.9.0", new, old)
    assert new.read_bytes() == b"kept"
    (site / "vllm-9.9.0.dist-info" / "RECORD").write_text("changed\n")
    devpack.vllm_tar(site, "9.9.0", new, old)
    assert new.read_bytes() != b"kept"
