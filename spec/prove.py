"""The proofs behind ``tailproof prove``: every lemma, the bounded check, the induction step and
the mutants.

:func:`run` (or a :class:`ProofRun` plus :func:`report`) returns one report with
``properties``, ``mutants`` and ``findings``; :func:`failed` says whether a proof failed
(counterexample or unknown) or a mutant survived; :func:`print_table` prints it as a table
(property, method, bound, result, seconds). Each mappable counterexample is handed to the
``export`` callback as a :class:`Counterexample`: writing it as a conformance trace is the
harness's job (``tailproof.conformance.tools.spec_export``), and so is the command line
(``tailproof.conformance.cli.prove``), so the spec imports nothing of the harness.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
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
    # vLLM 0.34's decode checkpoints (save_decode_cache): aligned decode states stored.
    ("0.34 decode checkpoints: one request decoding past 2 Mamba blocks",
     Config(prompts=((1, 1, 2),), responses=((2, 3, 3, 4, 4),), decode_checkpoints=True,
            num_blocks=6), 18, 14),
]

#: configurations vLLM supports whose counterexamples are reported, not failed on
FINDINGS: list[tuple[str, Config, int, str, str]] = [
    ("priority preemption of a same-step request", Config(priority_preempt=True), 8,
     "SchedulingPolicy.PRIORITY may preempt a request whose chunk was already scheduled and "
     "cached this step (Scheduler.schedule, SC:944-966, SC@0.34:960-982); its freed blocks "
     "keep keys whose KV/state was never computed, and a later lookup hits them",
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
    states: int | None = None  # states a bounded search explored (after symmetry reduction)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "method": self.method, "bound": self.bound,
                               "result": self.result, "seconds": round(self.seconds, 3)}
        if self.states is not None:
            out["states"] = self.states
        return out


def _bound(cfg: Config, depth: int) -> str:
    return f"K={depth} N={cfg.num_blocks} R={len(cfg.prompts)} W={cfg.workers}"


#: Submission order of the bounded checks, costliest first (measured CPU seconds at the full
#: bounds: only the pool's schedule depends on it, never a result)
_COSTLIEST_FIRST = (0, 7, 8, 6, 9, 2, 5, 1, 4, 3)


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Run one proof task; its result and the CPU seconds it took (the pool's accounting)."""
    c0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - c0


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which terminates them (no traceback per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_jobs() -> int:
    """The CPUs this process may run on (the bounded checks are independent)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class ProofRun:
    """Every proof task, started in a pool of ``jobs`` processes when created (``jobs`` = 1:
    run one after the other in :meth:`results`). ``tailproof check`` starts one before the
    corpus replays, so the proofs use the cores the replay leaves idle. A context manager: on
    exit (Ctrl-C included) the workers are terminated."""

    def __init__(self, quick: bool = False, jobs: int = 1, symmetry: bool = True) -> None:
        self.quick, self.jobs, self.symmetry = quick, jobs, symmetry
        self.t0 = time.monotonic()
        self.tasks = _tasks(quick, symmetry)
        # z3 first: its queries have wall-clock timeouts, best not met behind a busy core
        order = [0, 1] + [2 + i for i in _COSTLIEST_FIRST if i < len(BMC_INSTANCES)]
        self.order = order + [i for i in range(len(self.tasks)) if i not in order]
        self.pool: Any = None
        self.pending: dict[int, Any] = {}
        if jobs > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            self.pool = ctx.Pool(min(jobs, len(self.tasks)), initializer=_ignore_sigint)
            self.pending = {i: self.pool.apply_async(_timed, (self.tasks[i][1],
                                                              *self.tasks[i][2]))
                            for i in self.order}

    def __enter__(self) -> ProofRun:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Terminate the workers (a no-op once they are gone)."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def results(self, say: Callable[[str], None]) -> list[tuple[Any, float]]:
        """Every task's ``(result, cpu seconds)`` in task order, whatever order they finish in;
        ``say`` is told each task as it starts (one process) or ends (a pool)."""
        say(f"{len(self.tasks)} tasks in {self.jobs} worker "
            f"process{'es' if self.jobs > 1 else ''}")
        out: list[tuple[Any, float] | None] = [None] * len(self.tasks)
        if self.pool is None:
            for i in self.order:
                name, fn, args = self.tasks[i]
                say(name)
                out[i] = _timed(fn, *args)
        while self.pending:
            for i in [i for i, r in self.pending.items() if r.ready()]:
                res = out[i] = self.pending.pop(i).get()
                say(f"{self.tasks[i][0]}: done ({res[1]:.1f}s CPU)")
            if self.pending:
                next(iter(self.pending.values())).wait(0.05)
        self.close()
        return [r for r in out if r is not None]


def _tasks(quick: bool, symmetry: bool) -> list[tuple[str, Callable[..., Any], tuple]]:
    """(progress name, function, arguments) of every proof, in report order."""
    tasks: list[tuple[str, Callable[..., Any], tuple]] = [
        ("z3 lemmas", all_lemmas, ()), ("z3 induction step", all_induction, ())]
    for label, cfg, depth, qdepth in BMC_INSTANCES:
        d = qdepth if quick else depth
        if symmetry:
            tasks.append((f"all invariants [{label}] (BMC, depth {d})", bmc, (cfg, d)))
        else:
            tasks.append((f"all invariants [{label}] (BMC, depth {d}, no symmetry)",
                          _bmc_plain, (cfg, d)))
    for name in MUTANTS:
        tasks.append((f"mutant {name}", _mutant_task, (name, 12 if not quick else 11, symmetry)))
    tasks.append(("lemma and induction mutants", _z3_mutants, ()))
    for label, cfg, depth, _why, _fname in FINDINGS:
        tasks.append((f"finding: {label}", bmc, (cfg, depth)))
    return tasks


def _mutant_task(name: str, depth: int, symmetry: bool) -> Any:
    return run_mutant(name, Config(), depth, symmetry=symmetry)


def run(quick: bool = False, export: Export | None = None,
        progress: Callable[[str], None] | None = None, jobs: int = 1,
        symmetry: bool = True) -> dict[str, Any]:
    """Run everything; return the JSON report. ``progress`` is told each task as it starts
    (``jobs`` = 1) or finishes (a pool of ``jobs`` processes; the report's order is the same).
    ``symmetry`` = False turns the bounded search's symmetry reduction off (to compare counts)."""
    with ProofRun(quick, jobs, symmetry) as proofs:
        return report(proofs, export, progress)


def report(proofs: ProofRun, export: Export | None = None,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Wait for a :class:`ProofRun`'s results and build the JSON report (``seconds``: from the
    run's start); ``export`` is given each mappable counterexample and its answer becomes the
    entry's ``trace``."""
    say = progress or (lambda _name: None)
    quick = proofs.quick
    results = proofs.results(say)
    cpu = sum(c for _, c in results)
    res = iter(results)
    props: list[Row] = []
    for r in next(res)[0]:
        props.append(Row(r.name, "z3 (unbounded ints)", "all values", r.result, r.seconds))
    for r in next(res)[0]:
        props.append(Row(r.name, "z3 1-induction (per-block abstraction)", "all depths, any N",
                         r.result, r.seconds))
    names = ",".join(n for n, _ in ALL)
    coverage: dict[str, dict[str, int]] = {}
    for label, cfg, depth, qdepth in BMC_INSTANCES:
        d = qdepth if quick else depth
        b = next(res)[0]
        result = "holds" if b.ok else f"counterexample {b.violation}"
        if b.ok and b.closed:
            result = "holds (state space exhausted: all depths)"
        props.append(Row(f"all invariants [{label}]", f"explicit-state BMC, {b.states} states",
                         _bound(cfg, d), result, b.seconds, b.states))
        coverage[label] = b.coverage
    mutants: list[dict[str, Any]] = []
    for name in MUTANTS:
        m = next(res)[0]
        entry: dict[str, Any] = {"name": name, "killed": m.killed, "method": "BMC",
                                 "invariant": m.invariant, "message": m.message,
                                 "steps": len(m.trace or []), "seconds": round(m.seconds, 3),
                                 "mappable": bool(m.trace) and mappable(m.trace or [])}
        if m.trace and m.config.turn_end:  # no trace op schedules a decode step yet
            entry["mappable"] = False
            entry["unmappable_reason"] = ("a turn-end extension trace (decode steps); the "
                                          "extension's corpus cases cover it on impl")
        elif m.trace and m.config.decode_checkpoints:
            entry["mappable"] = False
            entry["unmappable_reason"] = ("decode steps (vLLM 0.34's decode checkpoints); "
                                          "the *_v034 corpus cases cover them")
        elif m.trace and not entry["mappable"]:
            entry["unmappable_reason"] = "runs a rank's store jobs out of FIFO order"
        if export is not None and m.trace and entry["mappable"]:
            entry["trace"] = export(Counterexample(f"spec_{name}", m.config, m.trace,
                                                   describe(name, m)))
        mutants.append(entry)
    lemma_ms, induction_ms = next(res)[0]
    for name, results_ in lemma_ms.items():
        killed = any(r.result == "counterexample" for r in results_)
        mutants.append({"name": f"lemma:{name}", "killed": killed, "method": "z3 lemma",
                        "message": next((r.name for r in results_
                                         if r.result == "counterexample"), None),
                        "seconds": round(sum(r.seconds for r in results_), 3)})
    for name, r in induction_ms.items():
        mutants.append({"name": f"induction:{name}", "killed": r.result == "counterexample",
                        "method": "z3 induction step", "message": r.model,
                        "seconds": round(r.seconds, 3)})
    findings = []
    for label, cfg, depth, why, fname in FINDINGS:
        b = next(res)[0]
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
            "findings": findings, "invariants": names.split(","), "bmc_coverage": coverage,
            "jobs": proofs.jobs, "symmetry": proofs.symmetry, "cpu_seconds": round(cpu, 3),
            "seconds": round(time.monotonic() - proofs.t0, 3)}


def _bmc_plain(cfg: Config, depth: int) -> Any:
    return bmc(cfg, depth, symmetry=False)


def _z3_mutants() -> tuple[dict[str, Any], dict[str, Any]]:
    return lemma_mutants(), induction_mutants()


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
        print("\nFindings about vLLM 0.33 and 0.34 (behaviour of vLLM the spec reports, the "
              "same code in both releases, docs/citations.md; not failures of tailproof, they "
              "do not change the exit status):")
    for f in report["findings"]:
        shown = "counterexample found" if f["result"] == "counterexample" else f["result"]
        print(f"  {f['name']}: {shown} ({f['invariant']}) -- {f['explanation']}")


def stderr_progress(t0: float) -> Callable[[str], None]:
    """Print each property as it starts, with the elapsed seconds, on stderr."""
    def say(name: str) -> None:
        print(f"prove [{time.monotonic() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)
    return say
