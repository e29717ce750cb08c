"""Regenerate the captured part of the corpus: ``conformance/cases/cap_*.json``.

``python -m tailproof.conformance.capture.corpus [--check]`` captures every named workload on
every geometry of ``workloads.GEOMETRIES`` (seed 0, token ids redacted) with ``tailproof
capture``'s code path (connector workloads: default geometry, ``--connector tailproof``);
``--check`` compares instead of writing (captures are deterministic).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tailproof.conformance.capture.run import capture
from tailproof.conformance.capture.workloads import GEOMETRIES, WORKLOADS

CASES = Path(__file__).resolve().parent.parent / "cases"


# "mixed" (>= 1,000 ops, the shrink test's input) is captured on the default geometry only.
# Connector workloads too (each ~1 s of capture; the store paths do not depend on geometry).
ONE_GEOMETRY = {"mixed"} | {w for w, wl in WORKLOADS.items() if wl.num_workers is not None}
# Calls of the scheduler's connector paths that have no op of their own: the async-load
# admission (``reserved_blocks`` in ``Scheduler.schedule``) and ``cache_blocks`` once a load
# finished (``_update_waiting_for_remote_kv``). Tolerated in connector captures only, which
# the corpus replay then checks op by op (0 divergences: they changed nothing observed).
CONNECTOR_PATH_CALLS = {"allocate_slots reservations / encoder tokens", "cache_blocks"}


def connector_of(workload: str) -> str:
    return "none" if WORKLOADS[workload].num_workers is None else "tailproof"


def corpus_entries() -> list[tuple[str, str, Path]]:
    default = next(iter(GEOMETRIES))
    return [(w, g, CASES / f"cap_{w}_{g}.json") for w in WORKLOADS for g in GEOMETRIES
            if w not in ONE_GEOMETRY or g == default]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="compare with the files, write none")
    p.add_argument("--only", help="comma-separated workloads")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for w, g, path in corpus_entries():
            if only and w not in only:
                continue
            out = Path(tmp) / path.name if args.check else path
            conn = connector_of(w)
            res = capture(w, out, seed=0, geometry=g, redact=True, connector=conn)
            unmodelled = set(res.unmodelled) - (CONNECTOR_PATH_CALLS if conn != "none" else set())
            if unmodelled:
                print(f"{path.name}: unmodelled calls {res.unmodelled}", file=sys.stderr)
                return 1
            print(f"{path.name}: {res.ops} ops, {res.steps} steps", file=sys.stderr)
            if args.check and (not path.exists() or path.read_text() != out.read_text()):
                stale.append(path.name)
    if stale:
        print(f"stale captures: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
