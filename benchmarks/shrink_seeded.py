"""Shrink figures: a bug planted in the reference model (a lookup that drops sub-block hits)
diverges on a captured trace; ``shrink`` reduces the trace to a minimal one with the same
divergence. Prints sizes before/after, replays used and wall time, and the shrunk trace.

Run: ``python -m benchmarks.shrink_seeded [TRACE] [-o small.json]`` (default trace:
``conformance/cases/cap_mixed_fa16-m16-h4.json``; figures in ``BENCHMARKS.md`` §5).
"""

from __future__ import annotations

import argparse
import os
import time

from tailproof.conformance.capture.writer import write_trace
from tailproof.conformance.format.trace import load_trace
from tailproof.conformance.harness.adapters import ADAPTERS, AdapterSpec
from tailproof.conformance.harness.adapters.reference_core import ReferenceCoreBackend
from tailproof.conformance.harness.corpus import CASES_DIR
from tailproof.conformance.tools.shrink import shrink


class LookupDropsSubBlockHits(ReferenceCoreBackend):
    """The planted bug: a prefix hit rounded down to whole scheduler blocks."""

    def lookup(self, rid: str, max_len: int | None) -> tuple[int, list[list[int]]]:
        hit, blocks = super().lookup(rid, max_len)
        return hit - hit % self.config.scheduler_block_size, blocks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace", nargs="?", default=str(CASES_DIR / "cap_mixed_fa16-m16-h4.json"))
    p.add_argument("-o", "--output")
    args = p.parse_args(argv)
    ADAPTERS["broken"] = AdapterSpec("broken", f"{__name__}:LookupDropsSubBlockHits", None,
                                     "planted lookup bug")
    trace = load_trace(args.trace)
    t0 = time.perf_counter()
    res = shrink(trace, ["reference", "broken"], strict=True,
                 log=lambda m: print(f"  {m}"))
    secs = time.perf_counter() - t0
    print(f"{trace.name}: {res.ops_before} ops -> {res.ops_after} ops, {res.runs} replays, "
          f"{secs:.1f} s, divergence {res.signature}, load {os.getloadavg()[0]:.1f}")
    if args.output:
        write_trace(res.doc, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
