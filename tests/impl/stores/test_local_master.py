"""The test/CLI master's log lives in a private folder and never follows a planted symlink."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tailproof.conformance.harness.local_master import LocalMaster


def test_log_goes_to_a_private_folder_removed_afterwards(mooncake_available: None) -> None:
    with LocalMaster() as m:
        folder = m.log_path.parent
        assert folder.name.startswith("tailproof-mooncake-") and len(folder.name) > 22
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(m.log_path.stat().st_mode) == 0o600
    assert not folder.exists()


def test_planted_symlink_is_not_followed(mooncake_available: None, tmp_path: Path) -> None:
    m = LocalMaster(log_dir=tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, m.log_path)
    with pytest.raises(OSError):
        m.start()
    assert victim.read_text() == "keep" and m.proc is None
