"""Author the historical-bug cases (``conformance/cases/hist_*.json``) with the case tools.

Each case starts from a corpus case that kills the bug's mutant, is shrunk with
``tailproof.conformance.tools.shrink`` while the mutant is applied (in a forked child, so unmutated
vLLM in this process never sees it: reference vs mutated vLLM is the divergence kept), renamed
after the bug, and its expectations are then recorded from unmutated vLLM with
``tailproof expect --adapters vllm-mooncake|vllm --in-place --overwrite``. ``FIXUPS`` holds the
few edits made after a shrink (commits the impl adapter needs, a second lookup), each stated in
the case's description.

    .venv/bin/python scripts/author_history_cases.py [BUG ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.releases import installed_release
from tailproof.conformance.tools.history.bugs import BUGS, Bug
from tailproof.conformance.tools.mutate.apply import apply_mutant
from tailproof.conformance.tools.mutate.catalog import MUTANTS
from tailproof.conformance.tools.shrink import shrink

CASES = Path(__file__).resolve().parents[2] / "cases"
BY_ID = {m.id: m for m in MUTANTS}


def _commit_after(doc: dict[str, Any], op_name: str, rid: str, nth: int = 0) -> None:
    """Insert ``commit rid`` after the ``nth`` ``op_name`` op (the shrink drops commits the
    impl adapter needs: its engine simulation only holds bytes for committed tokens)."""
    at = [i for i, o in enumerate(doc["ops"]) if o["op"] == op_name][nth]
    doc["ops"].insert(at + 1, {"op": "commit", "rid": rid})


def _fix_43559(doc: dict[str, Any]) -> str:
    _commit_after(doc, "conn_step", "A")
    at = [i for i, o in enumerate(doc["ops"]) if o["op"] == "store_lookup"][0]
    doc["ops"].insert(at, {"op": "lookup", "rid": "B"})
    return ("B's core lookup (HybridKVCacheCoordinator, the op that kills "
            "co-43559-eagle-margin-on-mamba) and its store lookup (MooncakeStoreCoordinator) "
            "each hit only the attention-verified prefix; A's commit and B's core lookup were "
            "added after the shrink.")


def _fix_51358(doc: dict[str, Any]) -> str:
    _commit_after(doc, "conn_step", "c0t1")
    _commit_after(doc, "allocate", "c0t0")
    return "The two commits were added after the shrink (so the puts read computed bytes)."


def _fix_52832(doc: dict[str, Any]) -> str:
    doc["ops"] += [{"op": "free", "rid": "A"}, {"op": "pool_state"}]
    return ("The request is then freed: the pinned boundary blocks stay referenced by the "
            "job (snapshot).")


def _fix_56615(doc: dict[str, Any]) -> str:
    _commit_after(doc, "conn_step", "A")
    return "A's last commit was added after the shrink (so the tail puts read computed bytes)."


#: Edits after the shrink, by bug number: each returns the sentence the description gains.
FIXUPS: dict[str, Callable[[dict[str, Any]], str]] = {
    "43559": _fix_43559, "51358": _fix_51358, "52832": _fix_52832, "56615": _fix_56615}


def _shrunk_under_mutant(bug: Bug, mutant: str, out: Path) -> None:
    """Child: apply ``mutant``, shrink the bug's seed case, write the small trace."""
    assert bug.seed_case and bug.case
    apply_mutant(BY_ID[mutant].at(installed_release()))
    trace = load_trace(CASES / f"{bug.seed_case}.json")
    # impl (TailproofConnector) joins connector traces, so the small trace stays one impl runs
    # too (its engine simulation checks the bytes every put reads).
    adapters = (["reference", "vllm-mooncake", "impl"] if "connector" in trace.raw["config"]
                else ["reference", "vllm"])
    res = shrink(trace, adapters, strict=True)
    doc = res.doc
    doc["name"] = bug.case
    doc["description"] = (f"{bug.ref}: {bug.statement} Shrunk by `tailproof shrink` from "
                          f"{bug.seed_case} ({res.ops_before} ops) with mutant "
                          f"{mutant} applied; expectations recorded from unmutated "
                          "vLLM 0.33.")
    for op in doc["ops"]:
        op.pop("expect", None)
    fix = FIXUPS.get(bug.number)
    if fix is not None:
        doc["description"] += " " + fix(doc)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def author(bug: Bug) -> Path:
    """Shrink ``bug``'s seed case into ``conformance/cases/<case>.json`` under its last mutant
    (with two, the store-side one, whose traces also run the core path)."""
    mutant = bug.mutants[-1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child exits
            code = 0
            try:
                _shrunk_under_mutant(bug, mutant, out)
            except Exception as e:  # noqa: BLE001 - reported by the parent
                print(f"{bug.ref}: {type(e).__name__}: {e}", file=sys.stderr)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not out.exists():
            raise SystemExit(f"{bug.ref}: shrinking under {mutant} failed")
        target = CASES / f"{bug.case}.json"
        target.write_text(out.read_text())
    return target


def main(argv: list[str]) -> int:
    wanted = set(argv)
    for bug in BUGS:
        if not (bug.seed_case and bug.mutants and bug.case):
            continue
        if wanted and bug.number not in wanted and bug.ref not in wanted:
            continue
        path = author(bug)
        print(f"{bug.ref}: {path.name} ({len(json.loads(path.read_text())['ops'])} ops)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
