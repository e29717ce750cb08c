"""Does each fixed bug's named case kill the mutants that re-introduce it, with that case alone?

The check is ``tailproof mutate``'s own machinery (``mutate.workload`` + ``mutate.run``) with a
workload of one corpus case and no generated traces: unmutated vLLM must match the case's
reference observations first, then each mutant runs in its own forked child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tailproof.conformance.harness.releases import installed_release
from tailproof.conformance.tools.history.bugs import BUGS, Bug
from tailproof.conformance.tools.mutate.catalog import MUTANTS
from tailproof.conformance.tools.mutate.run import KILLED, run_mutants
from tailproof.conformance.tools.mutate.workload import build_workload

CASES = Path(__file__).resolve().parents[2] / "cases"
BY_ID = {m.id: m for m in MUTANTS}


def case_path(name: str) -> Path:
    return CASES / f"{name}.json"


def case_ops(name: str) -> int | None:
    """The number of ops of a corpus case (None: no such case)."""
    import json

    p = case_path(name)
    return len(json.loads(p.read_text())["ops"]) if p.exists() else None


def verify_bug(bug: Bug, jobs: int = 2, timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """Per mutant of ``bug``: its status under the named case alone and the op that killed it."""
    if not bug.mutants or not bug.case or not case_path(bug.case).exists():
        return {}
    missing = [m for m in bug.mutants if m not in BY_ID]
    if missing:
        raise KeyError(f"{bug.ref}: mutant {missing[0]} is not in the catalog")
    workload = build_workload([case_path(bug.case)], 0, 0)
    if not workload.jobs:
        return {m: {"status": "not_run", "detail": "the case does not match unmutated vLLM"}
                for m in bug.mutants}
    release = installed_release()
    report = run_mutants([BY_ID[m].at(release) for m in bug.mutants], workload, jobs=jobs,
                         timeout_s=timeout_s)
    out: dict[str, dict[str, Any]] = {}
    for r in report.results:
        kb = r.killed_by or {}
        out[r.id] = {"status": r.status, "killed": r.status == KILLED,
                     "op_index": kb.get("op_index"), "op": kb.get("op")}
    return out


def verify_all(jobs: int = 2) -> dict[str, dict[str, dict[str, Any]]]:
    """``verify_bug`` for every entry that names mutants and a case."""
    return {b.ref: verify_bug(b, jobs) for b in BUGS if b.mutants and b.case}
