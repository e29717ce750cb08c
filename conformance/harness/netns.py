"""Run this process in a private, loopback-only network namespace.

Why: the Mooncake client (0.3.13) listens on every interface -- its handshake listener on
``0.0.0.0`` and its TCP data listener on ``[::]`` -- and no configuration, environment variable
or transfer-engine option binds them elsewhere (``MC_TCP_BIND_ADDRESS`` only changes the address
it advertises; the data acceptor is opened on ``tcp::v6()`` in ``tcp_transport.cpp``). So the
test suite and ``tailproof replay --store mooncake`` (which start their own master) move
themselves into a new network namespace whose only interface is ``lo``: a wildcard listener
there is reachable from this namespace only. The namespace has no name and disappears with the
last process in it (the master is a child, so it lives and dies inside it).

Needs CAP_SYS_ADMIN (root, as on this project's machines and CI). Namespaces are per thread:
call :func:`enter_loopback_namespace` from the main thread before any thread or child is
started; later threads and children inherit it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from pathlib import Path

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
_IFREQ = struct.Struct("16sH14x")
#: Set to "0" to stay in the caller's network namespace (e.g. to debug with host tools).
ENV_SWITCH = "TAILPROOF_NETNS"
#: Why the last :func:`enter_loopback_namespace` of this process did not isolate it (None: it
#: did, or it was not asked); shown by tests that need the isolation.
isolation_error: str | None = None


def interfaces() -> list[str]:
    """Network interfaces of this process's namespace."""
    return sorted(name for _, name in socket.if_nameindex())


def loopback_only() -> bool:
    """True when this process sees no interface but ``lo``."""
    return interfaces() == ["lo"]


def _set_lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = _IFREQ.pack(b"lo", 0)
        flags = _IFREQ.unpack(fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | IFF_UP))


def enter_loopback_namespace() -> str | None:
    """Move this process into a fresh namespace with only ``lo`` (up). Returns None on success
    (or when already loopback-only / disabled), else why it could not (the caller decides
    whether that is fatal)."""
    if os.environ.get(ENV_SWITCH) == "0":
        return f"disabled by {ENV_SWITCH}=0"
    if loopback_only():
        return None
    if threading.current_thread() is not threading.main_thread():
        return "not on the main thread"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (needs root / CAP_SYS_ADMIN)"
    _set_lo_up()
    return None


def listening_sockets() -> list[tuple[str, int, int]]:
    """(address, port, inode) of every TCP socket listening in this namespace (IPv4 and IPv6),
    from ``/proc/self/net/tcp{,6}``."""
    out = []
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/self/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(fam, raw), int(hexport, 16), int(f[9])))
    return out
