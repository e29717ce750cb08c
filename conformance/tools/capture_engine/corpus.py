"""Regenerate the captured part of the corpus: ``conformance/cases/cap_*.json``.

``python -m tailproof.conformance.tools.capture_engine.corpus [--check]`` captures every named
workload on every geometry of ``workloads.GEOMETRIES`` (seed 0, token ids redacted) with ``tailproof
capture``'s code path (connector workloads: default geometry, ``--connector tailproof``), and
the ``MOONCAKE`` workloads with ``--connector mooncake`` (vLLM's own ``MooncakeStoreConnector``;
default geometry, ``cap_<workload>_<geometry>_mooncake.json``); ``--check`` compares instead
of writing (captures are deterministic).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tailproof.conformance.tools.capture_engine.run import capture
from tailproof.conformance.tools.capture_engine.workloads import GEOMETRIES, WORKLOADS

CASES = Path(__file__).resolve().parents[2] / "cases"


# "mixed" (>= 1,000 ops, the shrink test's input) is captured on the default geometry only.
# Connector workloads too (each ~1 s of capture; the store paths do not depend on geometry).
ONE_GEOMETRY = {"mixed"} | {w for w, wl in WORKLOADS.items() if wl.num_workers is not None}
# Captured again with vLLM's MooncakeStoreConnector: store hits after a small device budget
# evicted the prefix (chat), and preemption with the store behind it.
MOONCAKE = ("chat", "preemption")


def connector_of(workload: str) -> str:
    return "none" if WORKLOADS[workload].num_workers is None else "tailproof"


def corpus_entries() -> list[tuple[str, str, str, Path]]:
    """(workload, geometry, connector, file) of every capture in the corpus."""
    default = next(iter(GEOMETRIES))
    out = [(w, g, connector_of(w), CASES / f"cap_{w}_{g}.json") for w in WORKLOADS
           for g in GEOMETRIES if w not in ONE_GEOMETRY or g == default]
    out += [(w, default, "mooncake", CASES / f"cap_{w}_{default}_mooncake.json")
            for w in MOONCAKE]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="compare with the files, write none")
    p.add_argument("--only", help="comma-separated workloads")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for w, g, conn, path in corpus_entries():
            if only and w not in only:
                continue
            out = Path(tmp) / path.name if args.check else path
            res = capture(w, out, seed=0, geometry=g, redact=True, connector=conn)
            if res.unmodelled:  # every call of a corpus capture is modelled
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
