"""Fixtures that run a real ``mooncake_master`` on 127.0.0.1 for the impl tests.

``mooncake_master`` (session) yields the address ``"127.0.0.1:PORT"`` of one master shared by the
session; ``mooncake_master_factory`` starts dedicated masters (``LocalMaster`` objects) for tests
that kill, freeze or restart theirs. Every master binds 127.0.0.1 on free ports and is stopped by
its PID (SIGTERM, then SIGKILL), never by name (see ``tailproof.conformance.harness.local_master``).
Tests needing Mooncake skip, naming what is missing, only when the ``mooncake`` package or
``libibverbs.so.1`` is missing; any other problem fails loudly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tailproof.conformance.harness.local_master import LocalMaster
from tailproof.impl.stores import StoreError

# Before any Mooncake client starts: never advertise a non-loopback address, keep glog quiet.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def mooncake_skip_reason() -> str | None:
    """Why Mooncake tests cannot run here (package or libibverbs missing), else None.

    Other import failures (e.g. the CUDA wheel on a machine without CUDA) fail the run."""
    from tailproof.impl.stores.mooncake import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return None
    if "not installed" in reason or "libibverbs" in reason:
        return reason
    pytest.fail(reason)


@pytest.fixture(scope="session")
def mooncake_available() -> None:
    """Skip (naming what is missing) when the Mooncake client cannot be imported here."""
    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)


def _start(log_dir: Path, extra_flags: tuple[str, ...] = ()) -> LocalMaster:
    master = LocalMaster(log_dir, extra_flags)
    try:
        return master.start()
    except StoreError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def mooncake_master(mooncake_available: None, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[str]:
    """Address ("127.0.0.1:PORT") of a master shared by the whole session."""
    master = _start(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master.address
    finally:
        master.stop()


@pytest.fixture
def mooncake_master_factory(mooncake_available: None, tmp_path: Path
                            ) -> Iterator[Callable[..., LocalMaster]]:
    """``start(*extra_flags) -> LocalMaster``: dedicated masters (kill/freeze/restart tests),
    all stopped by PID afterwards."""
    masters: list[LocalMaster] = []

    def start(*extra_flags: str) -> LocalMaster:
        m = _start(tmp_path, tuple(extra_flags))
        masters.append(m)
        return m

    try:
        yield start
    finally:
        for m in masters:
            m.stop()
