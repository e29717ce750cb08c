"""The two sides of ``tailproof diff``: which vLLM each one imports, and its worker process.

A side is written ``RELEASE`` (a release the bootstrap installs: ``scripts/vllm_env.sh``
gives the folder to put first on ``PYTHONPATH``, none for the venv's own) or
``RELEASE=FOLDER`` (any folder holding a ``vllm`` package, e.g. one built with
``scripts/vllm_overlay.sh``, a patched vLLM or a release candidate). ``RELEASE`` is the release
whose semantics the side is read with (``reference/releases.py``): the switches a change is
explained by. Each side runs in its own process (``worker.py``), so the two vLLMs never meet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tailproof.conformance.harness.errors import UsageError
from tailproof.reference.releases import RELEASES

ROOT = Path(__file__).resolve().parents[3]
VLLM_ENV = ROOT / "scripts" / "vllm_env.sh"


@dataclass(frozen=True)
class Side:
    """One side: its release and the folder that selects its vLLM (None: the venv's own)."""

    release: str
    folder: str | None
    text: str  # as the user wrote it

    @property
    def name(self) -> str:
        return self.text


def _holds_vllm(folder: str) -> bool:
    return (Path(folder) / "vllm" / "__init__.py").is_file()


def parse_side(text: str, option: str) -> Side:
    """``RELEASE`` or ``RELEASE=FOLDER``; a ``UsageError`` naming ``option`` otherwise."""
    release, sep, folder = text.partition("=")
    if release not in RELEASES:
        raise UsageError(f"{option}: {release!r} is not a release tailproof follows "
                         f"(known: {', '.join(RELEASES)})",
                         f"pass e.g. {option} 0.33, or {option} 0.34=/path/to/overlay")
    if sep:
        if not _holds_vllm(folder):
            raise UsageError(f"{option}: {folder} holds no vllm package",
                             "name a folder with vllm/__init__.py (scripts/vllm_overlay.sh "
                             "builds one)")
        return Side(release, str(Path(folder).resolve()), text)
    res = subprocess.run([str(VLLM_ENV), release], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    if res.returncode != 0:
        line = (res.stderr.strip().splitlines() or ["scripts/vllm_env.sh failed"])[-1]
        raise UsageError(f"{option}: {line}", "run scripts/bootstrap.sh, or pass "
                         f"{option} {release}=FOLDER")
    return Side(release, res.stdout.strip() or None, text)


def child_pythonpath(folder: str | None) -> str:
    """``folder`` first, then this process's ``PYTHONPATH`` without any folder holding vLLM
    (the other side's overlay must not shadow this side's)."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not _holds_vllm(p)]
    return os.pathsep.join(([folder] if folder else []) + keep)


class Worker:
    """One side's worker process (``worker.py``): started, checked, then asked to replay."""

    def __init__(self, side: Side, adapters: list[str]) -> None:
        self.side = side
        env = dict(os.environ, PYTHONPATH=child_pythonpath(side.folder))
        self._err: IO[str] = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tailproof.conformance.tools.diff.worker",
             ",".join(adapters)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            env=env, cwd=ROOT)
        self.hello = self._read()
        version = self.hello.get("version")
        where = side.folder or "the venv's own vLLM"
        if version is None:
            self.close()
            raise UsageError(f"{side.text}: no vLLM in {where}", "run scripts/bootstrap.sh")
        if self.hello.get("release") != side.release:
            self.close()
            raise UsageError(f"{side.text}: {where} holds vLLM {version}, not {side.release}",
                             f"pass {side.release}=FOLDER with a vLLM {side.release}.x")
        if self.hello.get("refusals"):
            why = next(iter(self.hello["refusals"].values()))
            self.close()
            raise UsageError(f"{side.text}: {why}", "see tailproof doctor")
        self.version: str = version
        self.requests = 0

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._err.seek(0)
            tail = (self._err.read().strip().splitlines() or ["(no output)"])[-1]
            raise UsageError(f"{self.side.text}: the worker stopped: {tail}",
                             "rerun with --debug, or check the release with tailproof doctor")
        return json.loads(line)

    def replay(self, doc: dict[str, Any], adapters: list[str]) -> dict[str, Any]:
        """What ``adapters`` observe on ``doc``'s ops on this side (``worker.replay``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"doc": doc, "adapters": adapters}) + "\n")
        self.proc.stdin.flush()
        self.requests += 1
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()
