"""The trace size limit holds for every kind of path (conformance/format/trace_file.py): a regular
file, a pipe (``<(cmd)``), a FIFO and a device; each bad one is exit 2 with one line, in
bounded time and memory, for every subcommand that loads traces."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format import limits
from tailproof.conformance.harness.corpus import corpus_paths

SMALL = min(corpus_paths(), key=lambda p: p.stat().st_size)
LIMIT = 4096  # a small limit keeps the oversized inputs small


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_FILE_BYTES", max(LIMIT, SMALL.stat().st_size))
    monkeypatch.setattr(limits, "MAX_PIPE_SECONDS", 0.5)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _writer(path: str, data: bytes, hold: threading.Event | None = None) -> threading.Thread:
    """Write ``data`` to a pipe/FIFO (opening a FIFO blocks until the reader opens it: the
    synchronisation), then keep it open until ``hold`` is set, if given."""
    def run() -> None:
        try:
            with open(path, "wb", buffering=0) as f:
                f.write(data)
                if hold is not None:
                    hold.wait(30)
        except OSError:  # the reader closed early: it refused the input
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def pipe() -> Iterator[tuple[str, int]]:
    """An anonymous pipe named as ``<(cmd)`` names it: ``/dev/fd/N`` of its read end."""
    r, w = os.pipe()
    yield f"/dev/fd/{r}", w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.mark.parametrize("cmd", [
    ["validate"], ["replay", "--against", "reference"], ["record", "--adapter", "reference"],
    ["shrink", "--against", "reference"]])
def test_device_refused_by_every_loader(cmd: list[str], capsys) -> None:
    assert main([*cmd, "/dev/zero"]) == 2  # refused by its type: nothing is read
    assert "/dev/zero: a character device: traces are read from regular files, pipes and " \
           "FIFOs" in _one_line(capsys)


def test_oversized_regular_file(tmp_path: Path, small_limits: None, capsys) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (limits.MAX_FILE_BYTES + 1))
    assert main(["validate", str(big)]) == 2
    assert f"larger than {limits.MAX_FILE_BYTES} bytes" in _one_line(capsys)


def test_oversized_pipe_stops_at_the_limit(pipe: tuple[str, int], small_limits: None,
                                           capsys) -> None:
    """The writer keeps the pipe open with more than the limit buffered: the reader stops
    at the limit instead of waiting for the end."""
    path, w = pipe
    os.write(w, b" " * (2 * limits.MAX_FILE_BYTES))  # fits the pipe's 64 KiB buffer
    tracemalloc.start()
    try:
        rc = main(["validate", path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 2
    assert f"larger than {limits.MAX_FILE_BYTES} bytes" in _one_line(capsys)
    assert peak < 8 * limits.MAX_FILE_BYTES + (1 << 20)


def test_pipe_whose_writer_is_gone_reads_to_eof(pipe: tuple[str, int], small_limits: None,
                                                capsys) -> None:
    """``<(cat t.json)``: cat often exits before tailproof opens the pipe; the buffered bytes
    are the whole trace (no POLLHUP comes for this reader: a read of 0 after data is EOF)."""
    path, w = pipe
    os.write(w, SMALL.read_bytes())
    os.close(w)
    assert main(["validate", path]) == 0  # read to EOF: the deadline path would exit 2
    assert capsys.readouterr().out.startswith(f"ok {path}:")


def test_fifo_with_a_writer(tmp_path: Path, small_limits: None, capsys) -> None:
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    t = _writer(str(fifo), SMALL.read_bytes())
    assert main(["validate", str(fifo)]) == 0
    t.join(10)
    assert capsys.readouterr().out.startswith(f"ok {fifo}:")


def test_fifo_nobody_writes_ends_at_the_deadline(tmp_path: Path, small_limits: None,
                                                 capsys) -> None:
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert main(["validate", str(fifo)]) == 2
    assert time.monotonic() - t0 >= limits.MAX_PIPE_SECONDS  # not before the deadline
    assert "not read in full within 0.5 s (no writer opened it" in _one_line(capsys)


def test_fifo_whose_writer_stalls_ends_at_the_deadline(tmp_path: Path, small_limits: None,
                                                       capsys) -> None:
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    hold = threading.Event()
    t = _writer(str(fifo), b'{"format": ', hold)
    t0 = time.monotonic()
    try:
        assert main(["validate", str(fifo)]) == 2
    finally:
        hold.set()
    t.join(10)
    assert time.monotonic() - t0 >= limits.MAX_PIPE_SECONDS  # not before the deadline
    assert "its writer did not finish; 11 bytes read" in _one_line(capsys)


def test_cli_dev_zero_is_fast_and_small() -> None:
    """The console command itself, as the issue ran it: exit 2, one line, bounded RSS."""
    # The peak RSS of this process image (VmHWM): getrusage's ru_maxrss survives exec, so it
    # would report the forking pytest process's size in a full suite run.
    code = ("import sys; from tailproof.conformance.cli.main import main; rc = main(sys.argv[1:]); "
            "print(next(ln.split()[1] for ln in open('/proc/self/status') "
            "if ln.startswith('VmHWM:')), file=sys.stderr); raise SystemExit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "validate", "/dev/zero"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    line, rss_kb = p.stderr.strip().splitlines()
    assert "character device" in line
    assert int(rss_kb) < 512 * 1024
