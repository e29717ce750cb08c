"""Nothing a test run starts listens beyond loopback.

Mooncake's client binds its handshake listener to ``0.0.0.0`` and its data listener to ``[::]``
(no option changes that), so the run lives in a loopback-only network namespace
(``tests/conftest.py``). Every listening TCP socket of the namespace (``/proc/self/net/tcp{,6}``)
must then be bound to a loopback address, or be a wildcard in a namespace whose only interface
is ``lo``.
"""

from __future__ import annotations

import ipaddress

import pytest

from tailproof.conformance.harness import netns
from tailproof.impl.stores import make_store


def test_no_socket_of_the_run_listens_beyond_loopback(mooncake_master: str) -> None:
    if not netns.loopback_only():
        pytest.skip(f"run not in a loopback-only namespace: {netns.isolation_error}")
    with make_store({"backend": "mooncake", "master_address": mooncake_master}):
        listening = netns.listening_sockets()
        wildcard = [s for s in listening if ipaddress.ip_address(s[0]).is_unspecified]
        # The check has teeth: Mooncake's own listeners are there, bound to every interface.
        assert wildcard, listening
        assert netns.interfaces() == ["lo"]
        for addr, port, _ in listening:
            ip = ipaddress.ip_address(addr)
            assert ip.is_loopback or ip.is_unspecified, (addr, port)
            if ip.version == 6 and ip.ipv4_mapped is not None:
                assert ip.ipv4_mapped.is_loopback, (addr, port)
