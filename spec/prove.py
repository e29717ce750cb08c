"""The proofs behind ``tailproof prove``: every lemma, the bounded check, the induction step and
the mutants.

:func:`run` returns one report with ``properties``, ``mutants`` and ``findings``;
:func:`failed` says whether a proof failed (counterexample or unknown) or a mutant survived;
:func:`print_table` prints it as a table (property, method, bound, result, seconds). Each
mappable counterexample is handed to ``run``'s ``export`` callback as a :class:`Counterexample`:
writing it as a conformance trace is the harness's job (``tailproof.conformance.spec_export``),
and so is the command line (``tailproof.conformance.prove_cli``), so the spec imports nothing
of the harness.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .invariants import ALL
from .model import Config
from .proofs.bmc import bmc
from .proofs.export import mappable
from .proofs.induction import all_induction, induction_mutants
from .proofs.lemmas import all_lemmas, lemma_mutants
from .proofs.mutants import MUTANTS, run_mutant

#: (label, config, depth, quick depth) of the bounded checks; N = num_blocks, R = requests
BMC_INSTANCES: list[tuple[str, Config, int, int]] = [
    ("h2 FA2 M4", Config(), 13, 9),
    ("h1 FA1 M2", Config(h=1, bs_fa=1, bs_mamba=2), 11, 8),
    ("defer_block_free", Config(defer_block_free=True), 11, 8),
    ("eagle h2 FA2 M4", Config(use_eagle=True, prompts=((1, 1, 2, 2, 3), (1, 1, 2, 2, 3, 3))),
     11, 8),
    ("h2 FA4 M4 (FA partial tail, FA CoW)",
     Config(h=2, bs_fa=4, bs_mamba=4, prompts=((1, 1, 2), (1, 1, 2, 2))), 12, 9),
    ("h2 FA2 M8 (lcm 8)",
     Config(h=2, bs_fa=2, bs_mamba=8, prompts=((1, 1, 2, 2, 3, 3), (1, 1, 2, 2, 3, 3, 4))),
     12, 9),
    # The turn-end extension (docs/reuse.md): decode steps, snapshot blocks, flush at finish.
    ("turn-end: one request decoding past 2 Mamba blocks",
     Config(prompts=((1, 1, 2),), responses=((2, 3, 3, 4, 4),), turn_end=True, num_blocks=6),
     20, 14),
    ("junction: the second prompt stops at the shared prefix, off the Mamba grid",
     Config(h=2, bs_fa=2, bs_mamba=8, prompts=((1, 1, 2, 2, 3, 3), (1, 1, 2, 2, 4, 4, 4)),
            junctions=(0, 4)), 13, 9),
    ("turn-end: the next turn's prompt is the first turn's prompt + response",
     Config(prompts=((1, 1, 2, 2), (1, 1, 2, 2, 3, 3)), responses=((3, 3), (4,)),
            turn_end=True), 12, 9),
]

#: configurations vLLM supports whose counterexamples are reported, not failed on
FINDINGS: list[tuple[str, Config, int, str, str]] = [
    ("priority preemption of a same-step request", Config(priority_preempt=True), 8,
     "SchedulingPolicy.PRIORITY may preempt a request whose chunk was already scheduled and "
     "cached this step (Scheduler.schedule, SC:944-966); its freed blocks keep keys whose "
     "KV/state was never computed, and a later lookup hits them",
     "spec_finding_priority_preempt_stale_keys"),
]


@dataclass(frozen=True)
class Counterexample:
    """A mappable counterexample ``run`` found: the harness may write it as a conformance trace."""

    name: str  # the trace's name (and file stem), e.g. ``spec_<mutant>``
    config: Config
    actions: list[tuple]
    description: str
    #: a finding: the trace ends with one more step in which this request looks its prefix up
    final_lookup: int | None = None


#: Writes a counterexample (the harness writes it as a trace) and answers where it went.
Export = Callable[[Counterexample], str]


@dataclass
class Row:
    """One line of the results table."""

    name: str
    method: str
    bound: str
    result: str
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "bound": self.bound,
                "result": self.result, "seconds": round(self.seconds, 3)}


def _bound(cfg: Config, depth: int) -> str:
    return f"K={depth} N={cfg.num_blocks} R={len(cfg.prompts)} W={cfg.workers}"


def run(quick: bool = False, export: Export | None = None,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run everything; return the JSON report. ``progress`` is told each property before it
    runs (the CLI prints it with the elapsed time); ``export`` is given each mappable
    counterexample and its answer becomes the entry's ``trace``."""
    say = progress or (lambda _name: None)
    props: list[Row] = []
    say("z3 lemmas")
    for r in all_lemmas():
        props.append(Row(r.name, "z3 (unbounded ints)", "all values", r.result, r.seconds))
    say("z3 induction step")
    for r in all_induction():
        props.append(Row(r.name, "z3 1-induction (per-block abstraction)", "all depths, any N",
                         r.result, r.seconds))
    names = ",".join(n for n, _ in ALL)
    coverage: dict[str, dict[str, int]] = {}
    for label, cfg, depth, qdepth in BMC_INSTANCES:
        d = qdepth if quick else depth
        say(f"all invariants [{label}] (BMC, depth {d})")
        b = bmc(cfg, d)
        res = "holds" if b.ok else f"counterexample {b.violation}"
        if b.ok and b.closed:
            res = "holds (state space exhausted: all depths)"
        props.append(Row(f"all invariants [{label}]", f"explicit-state BMC, {b.states} states",
                         _bound(cfg, d), res, b.seconds))
        coverage[label] = b.coverage
    mutants: list[dict[str, Any]] = []
    for name in MUTANTS:
        say(f"mutant {name}")
        m = run_mutant(name, Config(), 12 if not quick else 11)
        entry: dict[str, Any] = {"name": name, "killed": m.killed, "method": "BMC",
                                 "invariant": m.invariant, "message": m.message,
                                 "steps": len(m.trace or []), "seconds": round(m.seconds, 3),
                                 "mappable": bool(m.trace) and mappable(m.trace or [])}
        if m.trace and m.config.turn_end:  # no trace op schedules a decode step yet
            entry["mappable"] = False
            entry["unmappable_reason"] = ("a turn-end extension trace (decode steps); the "
                                          "extension's corpus cases cover it on impl")
        elif m.trace and not entry["mappable"]:
            entry["unmappable_reason"] = "runs a rank's store jobs out of FIFO order"
        if export is not None and m.trace and entry["mappable"]:
            entry["trace"] = export(Counterexample(f"spec_{name}", m.config, m.trace,
                                                   describe(name, m)))
        mutants.append(entry)
    say("lemma and induction mutants")
    for name, results in lemma_mutants().items():
        killed = any(r.result == "counterexample" for r in results)
        mutants.append({"name": f"lemma:{name}", "killed": killed, "method": "z3 lemma",
                        "message": next((r.name for r in results
                                         if r.result == "counterexample"), None),
                        "seconds": round(sum(r.seconds for r in results), 3)})
    for name, r in induction_mutants().items():
        mutants.append({"name": f"induction:{name}", "killed": r.result == "counterexample",
                        "method": "z3 induction step", "message": r.model,
                        "seconds": round(r.seconds, 3)})
    findings = []
    for label, cfg, depth, why, fname in FINDINGS:
        say(f"finding: {label}")
        b = bmc(cfg, depth)
        f: dict[str, Any] = {"name": label, "bound": _bound(cfg, depth),
                             "result": "holds" if b.ok else "counterexample",
                             "invariant": b.violation[0] if b.violation else None,
                             "message": b.violation[1] if b.violation else None,
                             "steps": [list(a) for a in b.trace or []], "explanation": why,
                             "seconds": round(b.seconds, 3)}
        if export is not None and b.trace and mappable(b.trace):
            f["trace"] = export(Counterexample(
                fname, cfg, b.trace, f"Spec finding: {why}. The spec's ghost check reports "
                f"{f['invariant']} ({f['message']}); the final lookup of r1 hits the "
                "never-computed blocks.", final_lookup=1))
        findings.append(f)
    return {"properties": [p.as_json() for p in props], "mutants": mutants,
            "findings": findings, "invariants": names.split(","), "bmc_coverage": coverage}


def describe(name: str, m: Any) -> str:
    """The description of an exported mutant counterexample."""
    what = MUTANTS[name].what
    return (f"Spec counterexample for the seeded mutant '{name}' ({what}): this op sequence is a "
            f"real vLLM 0.33 scenario reaching the rule's precondition; on the mutated model "
            f"it violates {m.invariant} ({m.message}). Reference and vLLM must agree on it.")


def failed(report: dict[str, Any]) -> bool:
    """A proof that did not go through or a mutant that survived."""
    bad = any(not (p["result"] in ("proved",) or p["result"].startswith("holds"))
              for p in report["properties"])
    return bad or any(not m["killed"] for m in report["mutants"])


def print_table(report: dict[str, Any]) -> None:
    rows = [("property", "method", "bound", "result", "seconds")]
    rows += [(p["name"], p["method"], p["bound"], p["result"], f"{p['seconds']:.2f}")
             for p in report["properties"]]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(5)]
    for r in rows:
        print("  ".join(c[: widths[i]].ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    print("\nBMC coverage (new states witnessing each event):")
    for label, cov in report.get("bmc_coverage", {}).items():
        print(f"  {label}: " + ", ".join(f"{k} {v}" for k, v in sorted(cov.items())))
    killed = sum(m["killed"] for m in report["mutants"])
    print(f"\nmutants: {killed}/{len(report['mutants'])} killed")
    for m in report["mutants"]:
        mark = "killed " if m["killed"] else "SURVIVED"
        print(f"  {mark} {m['name']:<30} {m['method']:<18} {m.get('invariant') or ''} "
              f"{(m.get('message') or '')[:70]}")
    if report["findings"]:
        print("\nFindings about vLLM 0.33 (behaviour of vLLM the spec reports; not failures of "
              "tailproof, they do not change the exit status):")
    for f in report["findings"]:
        shown = "counterexample found" if f["result"] == "counterexample" else f["result"]
        print(f"  {f['name']}: {shown} ({f['invariant']}) -- {f['explanation']}")


def stderr_progress(t0: float) -> Callable[[str], None]:
    """Print each property as it starts, with the elapsed seconds, on stderr."""
    def say(name: str) -> None:
        print(f"prove [{time.monotonic() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)
    return say

