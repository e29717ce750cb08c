"""``tailproof replay --against reference,impl --store mooncake`` runs the whole corpus on a
real Mooncake master (started for the run and stopped by PID) with 0 divergences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailproof.conformance.cli import corpus_paths, main

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm]


def _master_pids() -> set[int]:
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "comm").read_text().strip().startswith("mooncake_maste"):
                    pids.add(int(p.name))
            except OSError:
                continue
    return pids


def test_whole_corpus_on_a_real_mooncake_started_by_the_cli(
        mooncake_master: str, capsys: pytest.CaptureFixture[str]) -> None:
    # mooncake_master proves the package and libibverbs are usable here (else it skips).
    before = _master_pids()
    rc = main(["replay", *map(str, corpus_paths()), "--against", "reference,impl",
               "--store", "mooncake", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["divergences"] == [], out["divergences"][:1]
    assert rc == 0 and out["cases"] == len(corpus_paths())
    assert _master_pids() == before  # the CLI stopped the master it started


def test_memory_store_and_given_master(mooncake_master: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    conn = [str(p) for p in corpus_paths() if p.name.startswith("conn_")]
    for extra in (["--store", "memory"], ["--store", "mooncake", "--mooncake-master",
                                          mooncake_master]):
        rc = main(["replay", *conn, "--against", "reference,impl", "--json", *extra])
        out = json.loads(capsys.readouterr().out)
        assert (rc, out["divergences"]) == (0, []), extra
