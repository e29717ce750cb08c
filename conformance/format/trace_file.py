"""Read a trace's bytes from any kind of path, bounded in size and time.

Traces are outside input (docs/security.md, "Bounded readers"). The rule, by what the path
names (``os.stat``, so ``/dev/fd/N`` of ``<(cmd)`` is the pipe behind it):

* a regular file: at most ``MAX_FILE_BYTES`` (checked on the bytes read, not on ``st_size``:
  a file that grows, or a ``/proc`` file reporting size 0, is still cut off);
* a pipe or FIFO (``<(cat t.json)``, ``mkfifo``): opened non-blocking, read up to the same
  size within ``MAX_PIPE_SECONDS`` in all; a FIFO no writer opens, or one that drips, ends
  in an error at the deadline instead of blocking forever;
* anything else (a character or block device such as ``/dev/zero``, a socket): refused
  before it is opened, so opening it has no side effect.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import time
from pathlib import Path

from tailproof.conformance.format import limits

_CHUNK = 1 << 16
#: longest wait of one poll of a pipe between probes for a writer that has gone
_POLL_MS = 100


class ReadRefused(ValueError):
    """The path cannot be read as a trace; ``str()`` is the cause (without the path)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _too_big() -> ReadRefused:
    return ReadRefused(f"larger than {limits.MAX_FILE_BYTES} bytes (the limit)")


def _read_file(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.read(fd, _CHUNK):
        out += chunk
        if len(out) > limits.MAX_FILE_BYTES:
            raise _too_big()
    return bytes(out)


def _read_pipe(fd: int, seconds: float) -> bytes:
    """Everything written to a non-blocking pipe/FIFO until its writer closes it.

    Linux reports POLLHUP only to a reader that saw a writer come and go (``pipe_poll``), so a
    read that returns 0 is EOF once data was read or after a hang-up, and "no writer yet"
    otherwise (a FIFO nobody opened): then it waits, up to the deadline."""
    deadline = time.monotonic() + seconds
    out = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    hung_up = False
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:  # a writer is there, nothing written yet
            chunk = None
        if chunk:
            out += chunk
            if len(out) > limits.MAX_FILE_BYTES:
                raise _too_big()
            continue
        if chunk == b"" and (out or hung_up):
            return bytes(out)
        left = deadline - time.monotonic()
        if left <= 0:
            what = "no writer opened it" if chunk == b"" else "its writer did not finish"
            raise ReadRefused(f"a pipe/FIFO not read in full within {seconds:g} s ({what}; "
                              f"{len(out)} bytes read)")
        events = poller.poll(min(left * 1000, _POLL_MS))
        hung_up = any(ev & select.POLLHUP for _, ev in events)


def read_trace_bytes(path: str | Path, pipe_seconds: float | None = None) -> bytes:
    """The bytes of the trace at ``path`` under the rule above; ReadRefused or OSError."""
    seconds = limits.MAX_PIPE_SECONDS if pipe_seconds is None else pipe_seconds
    mode = os.stat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise ReadRefused(f"{_kind(mode)}: traces are read from regular files, pipes and "
                          "FIFOs")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode  # what was opened, if the path changed since the stat
        if stat.S_ISREG(mode):
            if os.fstat(fd).st_size > limits.MAX_FILE_BYTES:
                raise _too_big()
            os.set_blocking(fd, True)
            return _read_file(fd)
        if stat.S_ISFIFO(mode):
            return _read_pipe(fd, seconds)
        raise OSError(errno.EINVAL, f"{_kind(mode)}: the path changed while it was opened")
    finally:
        os.close(fd)
