"""The GPU check's pack (``.devpack/``): what scripts/device_pack.sh builds and
scripts/device_check.sh reads back. Standard library only: it runs here under the project's
Python 3.11 and on the lent machine under its Python 3.12, before anything is installed.

    devpack.py source-digest ROOT
    devpack.py vllm-tar SITE VERSION OUT.tar.xz [--reuse OLD_PACK]
    devpack.py vllm-digest SITE VERSION
    devpack.py manifest PACK LIMIT_MIB KEY=VALUE...
    devpack.py verify PACK
    devpack.py unpack TAR.XZ DIR
    devpack.py merge OUT.json NAME=FILE...
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

#: the project's package folders (setup.py PARTS): what its wheel is built from
PARTS = ("tailproof", "spec", "reference", "impl", "conformance")
#: the files of a vLLM release the check needs: its Python sources and the data they read
VLLM_SUFFIXES = (".py", ".json", ".jinja", ".typed")
DIST_INFO_FILES = ("METADATA", "entry_points.txt", "top_level.txt")
MANIFEST = "MANIFEST.txt"
MIB = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_digest(root: Path) -> str:
    """sha256 over the ``.py`` and ``.json`` files of the package folders (path and bytes):
    equal here and on the lent machine when its tree is the one the pack was built from."""
    h = hashlib.sha256()
    for part in PARTS:
        for dirpath, dirnames, filenames in os.walk(root / part):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".json")):
                    p = Path(dirpath) / name
                    h.update(p.relative_to(root).as_posix().encode() + b"\0")
                    h.update(p.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def _dist_info(site: Path, version: str) -> Path:
    d = site / f"vllm-{version}.dist-info"
    if not (d / "METADATA").is_file():
        raise SystemExit(f"devpack: no vllm {version} in {site} (missing {d.name}; run make venv)")
    return d


def vllm_digest(site: Path, version: str) -> str:
    """The installed release's identity: its RECORD (every file's hash, as pip wrote it)."""
    return "sha256:" + sha256_file(_dist_info(site, version) / "RECORD")


def _add(tar: tarfile.TarFile, path: Path, arcname: str) -> int:
    data = path.read_bytes()
    info = tarfile.TarInfo(arcname)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return len(data)


def vllm_tar(site: Path, version: str, out: Path, reuse: Path | None) -> None:
    """``vllm/`` (sources and data only: no compiled ``.so``, no headers, no ``vllm-rs``) and
    the release's ``dist-info`` (version, entry points), as a reproducible ``tar.xz``. An
    earlier pack's tarball of the same release and RECORD is reused (xz takes a minute)."""
    digest = vllm_digest(site, version)
    if reuse is not None:
        old = reuse / out.name
        if old.is_file() and manifest_value(reuse, f"vllm {version}") == digest:
            out.write_bytes(old.read_bytes())
            print(f"devpack: vllm {version}: reused {old}", file=sys.stderr)
            return
    files, nbytes = 0, 0
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for dirpath, dirnames, filenames in os.walk(site / "vllm"):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(VLLM_SUFFIXES):
                    p = Path(dirpath) / name
                    nbytes += _add(tar, p, p.relative_to(site).as_posix())
                    files += 1
        info_dir = _dist_info(site, version)
        for name in DIST_INFO_FILES:
            if (info_dir / name).is_file():
                _add(tar, info_dir / name, f"{info_dir.name}/{name}")
    print(f"devpack: vllm {version}: {files} files, {nbytes / MIB:.1f} MiB unpacked, "
          f"{out.stat().st_size / MIB:.1f} MiB packed", file=sys.stderr)


def manifest_value(pack: Path, key: str) -> str | None:
    """A ``key: value`` header line of the pack's manifest, or None."""
    m = pack / MANIFEST
    if not m.is_file():
        return None
    for line in m.read_text().splitlines():
        if line.startswith(f"{key}: "):
            return line[len(key) + 2:]
    return None


def write_manifest(pack: Path, limit_mib: float, pairs: list[str]) -> int:
    """``MANIFEST.txt``: the pack's size against its limit, the header ``pairs`` (``KEY=VALUE``),
    then one line per file (size, sha256, path). Exit status 1 when over the limit."""
    files = sorted(p for p in pack.rglob("*") if p.is_file() and p.name != MANIFEST)
    rows = [(p.stat().st_size, sha256_file(p), p.relative_to(pack).as_posix()) for p in files]
    header = [f"{k}: {v}" for k, v in (pair.split("=", 1) for pair in pairs)]
    body = [f"file\t{size}\t{digest}\t{path}" for size, digest, path in rows]
    # The manifest counts itself: the stated size is the fixed point of the text's own length.
    stated, total, text = -1, sum(r[0] for r in rows), ""
    while stated != total:
        stated = total
        text = "\n".join([
            "tailproof device pack (scripts/device_pack.sh; read by scripts/device_check.sh)",
            f"size: {stated} bytes ({stated / MIB:.1f} MiB) of at most {limit_mib:g} MiB",
            *header, "", "kind\tbytes\tsha256\tpath", *body, ""])
        total = sum(r[0] for r in rows) + len(text.encode())
    (pack / MANIFEST).write_text(text)
    print(text, end="")
    if total > limit_mib * MIB:
        print(f"devpack: the pack is {total / MIB:.1f} MiB, over its {limit_mib:g} MiB limit",
              file=sys.stderr)
        return 1
    return 0


def verify(pack: Path) -> int:
    """Every file the manifest lists is there with its size and hash (a partial or stale carry
    is named, one line); prints the manifest's header lines."""
    m = pack / MANIFEST
    if not m.is_file():
        print(f"devpack: no {m} (build it with scripts/device_pack.sh, carry {pack.name})")
        return 1
    bad = []
    for line in m.read_text().splitlines():
        if line.startswith("file\t"):
            _, size, digest, path = line.split("\t")
            p = pack / path
            if not p.is_file() or p.stat().st_size != int(size) or sha256_file(p) != digest:
                bad.append(path)
        elif line and not line.startswith("kind\t"):
            print(line)
    if bad:
        print(f"devpack: {len(bad)} file(s) of the pack missing or changed: {', '.join(bad)}")
        return 1
    return 0


def unpack(archive: Path, dest: Path) -> int:
    """Extract a pack tarball (the stdlib's lzma: no ``xz`` program needed on the machine)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        if any(n.startswith(("/", "..")) or "/../" in n for n in names):
            print(f"devpack: {archive} holds paths outside its folder", file=sys.stderr)
            return 1
        # the "data" filter (3.12; 3.11.4+) refuses links and modes outside the folder too
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, **kw)
    return 0


def merge(out: Path, pairs: list[str]) -> int:
    """One JSON object ``{NAME: the JSON of FILE}`` (an unreadable file: ``{"error": ...}``)."""
    merged = {}
    for pair in pairs:
        name, path = pair.split("=", 1)
        p = Path(path)
        if not p.is_file() or p.stat().st_size == 0:
            merged[name] = {"error": "no output: the command's messages are in the step's log"}
            continue
        try:
            merged[name] = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            merged[name] = {"error": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "source-digest" and len(args) == 1:
        print(source_digest(Path(args[0])))
        return 0
    if cmd == "vllm-tar" and len(args) in (3, 5):
        reuse = Path(args[4]) if len(args) == 5 and args[3] == "--reuse" else None
        vllm_tar(Path(args[0]), args[1], Path(args[2]), reuse)
        return 0
    if cmd == "vllm-digest" and len(args) == 2:
        print(vllm_digest(Path(args[0]), args[1]))
        return 0
    if cmd == "manifest" and len(args) >= 2:
        return write_manifest(Path(args[0]), float(args[1]), args[2:])
    if cmd == "verify" and len(args) == 1:
        return verify(Path(args[0]))
    if cmd == "unpack" and len(args) == 2:
        return unpack(Path(args[0]), Path(args[1]))
    if cmd == "merge" and len(args) >= 1:
        return merge(Path(args[0]), args[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
