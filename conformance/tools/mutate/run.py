"""Run mutants against the workload, one fresh forked process per mutant.

The parent imports vLLM once, builds the workload and checks that unmutated vLLM matches the
reference on every trace; each mutant then runs in a child forked from that parent (its own
copy of memory: a mutant never leaks into the next one, and vLLM is not re-imported). The child
applies the mutant and replays the traces until an observation differs from the reference:
that trace and op killed it. A child that exceeds the timeout is killed and counts as killed
by timeout (a hang is a detected bug); one that dies without a result counts as killed by a
crash.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailproof.conformance.harness.adapters import make_driver
from tailproof.conformance.harness.releases import installed_release
from tailproof.conformance.tools.mutate.apply import StaleMutant, apply_mutant
from tailproof.conformance.tools.mutate.catalog import MUTANTS, Mutant, module_label
from tailproof.conformance.tools.mutate.workload import Job, Workload

KILLED, SURVIVED, EQUIVALENT, STALE, BROKEN = (
    "killed", "survived", "equivalent", "stale", "broken")
STATUSES = (KILLED, SURVIVED, EQUIVALENT, STALE, BROKEN)


@dataclass
class MutantResult:
    id: str
    module: str
    function: str
    why: str
    upstream: str | None
    status: str
    killed_by: dict[str, Any] | None = None
    detail: str | None = None
    seconds: float = 0.0
    traces_run: int = 0

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Report:
    results: list[MutantResult]
    workload: dict[str, Any]
    seconds: float
    jobs: int
    load: tuple[float, float, float]
    by_module: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.results:
            row = self.by_module.setdefault(r.module, {"total": 0, **{s: 0 for s in STATUSES}})
            row["total"] += 1
            row[r.status] += 1

    @property
    def scored(self) -> list[MutantResult]:
        """Mutants that count towards the score (not equivalent, stale or broken)."""
        return [r for r in self.results if r.status in (KILLED, SURVIVED)]

    @property
    def score(self) -> float:
        n = len(self.scored)
        return sum(r.status == KILLED for r in self.scored) / n if n else 1.0

    def as_json(self) -> dict[str, Any]:
        return {
            "score": round(self.score, 4),
            "non_equivalent": len(self.scored),
            "killed": sum(r.status == KILLED for r in self.results),
            "survived": sum(r.status == SURVIVED for r in self.results),
            "equivalent": sum(r.status == EQUIVALENT for r in self.results),
            "stale": sum(r.status == STALE for r in self.results),
            "broken": sum(r.status == BROKEN for r in self.results),
            "by_module": self.by_module,
            "workload": self.workload,
            "seconds": round(self.seconds, 1),
            "parallel_jobs": self.jobs,
            "loadavg": [round(x, 2) for x in self.load],
            "mutants": [r.as_json() for r in self.results],
        }


def select(module: str | None = None, sample: int | None = None,
           ids: list[str] | None = None) -> list[Mutant]:
    """The catalog filtered by module label (substring), ids, and a fixed sample: every
    k-th mutant in catalog order, so the same sample is drawn every run. A mutant of one
    release's rule is left out unless that release is installed; each is written as the
    installed release reads it (``Mutant.at``)."""
    release = installed_release()
    chosen = [m.at(release) for m in MUTANTS
              if m.release in (None, release) and (not ids or m.id in ids)]
    chosen = [m for m in chosen if module is None or module in module_label(m.module)]
    if sample is not None and 0 < sample < len(chosen):
        step = len(chosen) / sample
        chosen = [chosen[int(i * step)] for i in range(sample)]
    return chosen


def _relevant(m: Mutant, job: Job) -> bool:
    """A Mooncake mutant cannot change a trace that never runs the connector."""
    return job.uses_connector or not m.connector_only


def _replay(m: Mutant, jobs: list[Job]) -> dict[str, Any]:
    """Run in the child: replay until the first observation that differs from the reference."""
    run = 0
    for job in jobs:
        if not _relevant(m, job):
            continue
        run += 1
        try:  # a reference mutant is compared with the unmutated reference it breaks
            driver = make_driver("reference" if m.on_reference else job.adapter, job.config)
        except Exception as e:  # noqa: BLE001 - a mutant that breaks set-up is caught
            return {"status": KILLED, "traces_run": run, "killed_by": {
                "trace": job.name, "source": job.source, "op_index": -1, "op": "(setup)",
                "got": {"error": type(e).__name__}}}
        for i, op in enumerate(job.ops):
            got = driver.apply(op)
            want = job.reference[i]
            if got is not None and want is not None and got != want:
                return {"status": KILLED, "traces_run": run, "killed_by": {
                    "trace": job.name, "source": job.source, "op_index": i, "op": op["op"],
                    "expected": want, "got": got}}
    return {"status": SURVIVED, "traces_run": run}


def _child(m: Mutant, jobs: list[Job], out: Path) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        try:
            apply_mutant(m)
        except StaleMutant as e:
            res: dict[str, Any] = {"status": STALE, "detail": str(e)}
        except Exception:  # noqa: BLE001 - a mutant that does not compile is reported
            res = {"status": BROKEN, "detail": traceback.format_exc(limit=3)[-600:]}
        else:
            res = _replay(m, jobs)
        out.write_text(json.dumps(res))
    finally:
        os._exit(0)


def _finish(m: Mutant, res: dict[str, Any], seconds: float) -> MutantResult:
    status = res["status"]
    detail = res.get("detail")
    if m.equivalent:
        if status == SURVIVED:
            status, detail = EQUIVALENT, m.equivalent
        elif status == KILLED:
            detail = f"declared equivalent ({m.equivalent}) but killed"
    return MutantResult(m.id, module_label(m.module), m.qualname, m.why, m.upstream, status,
                        res.get("killed_by"), detail, round(seconds, 2),
                        res.get("traces_run", 0))


def run_mutants(mutants: list[Mutant], workload: Workload, jobs: int = 2,
                timeout_s: float = 300.0, progress: Any = None) -> Report:
    """Run every mutant in its own forked child, at most ``jobs`` at a time."""
    t0 = time.perf_counter()
    results: dict[str, MutantResult] = {}
    pending = list(mutants)
    running: dict[int, tuple[Mutant, float, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="tailproof-mutate-") as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                m = pending.pop(0)
                out = Path(tmp) / f"{m.id}.json"
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child never returns
                    _child(m, workload.jobs, out)
                running[pid] = (m, time.perf_counter(), out)
            time.sleep(0.02)
            for pid, (m, started, out) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                elapsed = time.perf_counter() - started
                if done == 0:
                    if elapsed <= timeout_s:
                        continue
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    res: dict[str, Any] = {"status": KILLED, "killed_by": {
                        "timeout_s": timeout_s}}
                elif out.exists():
                    res = json.loads(out.read_text())
                else:
                    res = {"status": KILLED, "killed_by": {
                        "crash": os.waitstatus_to_exitcode(status)}}
                del running[pid]
                results[m.id] = _finish(m, res, elapsed)
                if progress is not None:
                    progress(len(results), len(mutants), results[m.id])
    ordered = [results[m.id] for m in mutants]
    return Report(ordered, workload.counts(), time.perf_counter() - t0, jobs, os.getloadavg())


def format_report(report: Report) -> str:
    """The per-module table, every survivor with its reason, and the score."""
    lines = [f"{'module':<30} {'total':>5} {'killed':>6} {'surv.':>5} {'equiv.':>6} "
             f"{'stale':>5} {'broken':>6}"]
    for mod, row in sorted(report.by_module.items()):
        lines.append(f"{mod:<30} {row['total']:>5} {row[KILLED]:>6} {row[SURVIVED]:>5} "
                     f"{row[EQUIVALENT]:>6} {row[STALE]:>5} {row[BROKEN]:>6}")
    for r in report.results:
        if r.status in (SURVIVED, STALE, BROKEN):
            lines.append(f"  {r.status.upper()} {r.id} ({r.module}.{r.function}): {r.why}"
                         + (f" -- {r.detail.strip().splitlines()[-1]}" if r.detail else ""))
    w = report.workload
    j = report.as_json()
    lines.append(
        f"mutation score: {j['killed']}/{j['non_equivalent']} killed ({100 * report.score:.1f}%)"
        f", {j['equivalent']} equivalent, {j['stale']} stale, {j['broken']} broken; workload "
        f"{w.get('corpus', 0)} cases + {w.get('generated-core', 0)} generated core + "
        f"{w.get('generated-connector', 0)} generated connector traces; "
        f"{report.seconds:.0f}s with {report.jobs} jobs (load "
        f"{', '.join(f'{x:.1f}' for x in report.load)})")
    return "\n".join(lines)
