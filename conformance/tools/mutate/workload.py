"""What a mutant must survive: the case corpus plus a fixed budget of generated traces, each
with the reference model's observations to compare against.

Each trace runs on the vLLM adapter that exercises it: ``vllm`` (vLLM's ``KVCacheManager``)
for core-only traces, ``vllm-mooncake`` (plus the Mooncake store scheduler and sending thread)
for traces with connector ops. The reference observations are what the conformance suite
compares vLLM with; unmutated vLLM matches them exactly (block ids included), which the runner
checks once before any mutant runs.

Generated traces come from the project's two generators with hypothesis derandomized, so the
same code always yields the same traces: ``conformance.generate.lockstep_trace`` (core) and the
connector strategy in ``tests/connector/strategies.py`` (loaded from the checkout when present),
over its geometries and, as a budget of its own, over its sliding-window geometries.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailproof.conformance.format.ops import CORE_OPS
from tailproof.conformance.format.trace import Trace, TraceConfig, load_trace, parse_trace
from tailproof.conformance.harness.adapters import make_driver, refusal
from tailproof.conformance.harness.releases import ReleaseGate

CORPUS = "corpus"
GEN_CORE = "generated-core"
GEN_CONN = "generated-connector"
REPO_ROOT = Path(__file__).resolve().parents[3]
CONNECTOR_STRATEGIES = REPO_ROOT / "tests" / "connector" / "strategies.py"


@dataclass
class Job:
    """One trace to replay under a mutant."""

    name: str
    source: str  # CORPUS, GEN_CORE or GEN_CONN
    adapter: str  # "vllm" or "vllm-mooncake"
    config: TraceConfig
    ops: list[dict[str, Any]]
    reference: list[dict[str, Any] | None] = field(default_factory=list)

    @property
    def uses_connector(self) -> bool:
        return self.adapter == "vllm-mooncake"


@dataclass
class Workload:
    jobs: list[Job]
    dropped: list[str]  # traces where unmutated vLLM already differs from the reference
    seconds_build: float = 0.0
    seconds_baseline: float = 0.0

    def counts(self) -> dict[str, int]:
        out = {CORPUS: 0, GEN_CORE: 0, GEN_CONN: 0}
        for j in self.jobs:
            out[j.source] += 1
        out["ops"] = sum(len(j.ops) for j in self.jobs)
        out["dropped"] = len(self.dropped)
        return out


def _job(trace: Trace, source: str) -> Job:
    connector = any(op["op"] not in CORE_OPS for op in trace.ops)
    return Job(trace.name, source, "vllm-mooncake" if connector else "vllm", trace.config,
               trace.ops)


def observe(job: Job, adapter: str) -> list[dict[str, Any] | None]:
    driver = make_driver(adapter, job.config)
    return [driver.apply(op) for op in job.ops]


def _collect(strategy: Any, n: int, label: str) -> list[dict[str, Any]]:
    """``n`` trace documents drawn from ``strategy`` with hypothesis derandomized (the same
    traces every run). Draws whose adapters already disagree are skipped (they are the
    property tests' business, and the baseline check would drop them anyway)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    docs: list[dict[str, Any]] = []
    if n <= 0:
        return docs

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              print_blob=False)
    @given(st.data())
    def draw(data: Any) -> None:
        try:
            run = data.draw(strategy)
        except AssertionError:  # a lockstep divergence or a generator assertion
            return
        doc = run.doc([dict(o) for o in run.ops])
        doc["name"] = f"{label}-{len(docs):03d}"
        docs.append(doc)

    draw()
    return docs


def _connector_strategy(window: bool = False) -> Any | None:
    """The connector strategy over its geometries, or (``window``) its sliding-window ones."""
    if not CONNECTOR_STRATEGIES.exists():
        return None
    name = "tailproof_connector_strategies"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CONNECTOR_STRATEGIES)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    module = sys.modules[name]
    return module.connector_trace(module.WINDOW_GEOMETRIES if window else None)


def build_workload(corpus: list[Path], generated_core: int, generated_connector: int,
                   baseline: bool = True, generated_window: int = 0) -> Workload:
    """Load the corpus, draw the generated traces, record the reference observations and
    (``baseline``) drop any trace on which unmutated vLLM does not match them exactly.
    ``generated_window`` connector traces with a sliding-window group come on top of
    ``generated_connector`` (counted with them)."""
    t0 = time.perf_counter()
    # Cases of the turn-end checkpoint extension are not vLLM's to run (their mutants are
    # ``impl_extension``'s): the vLLM adapters refuse them, and a case of another vLLM
    # release that the installed one disagrees on (docs/releases.md).
    jobs = []
    for p in corpus:
        t = load_trace(p)
        j = _job(t, CORPUS)
        if refusal(j.adapter, t.config) is None and ReleaseGate(t).refusal(j.adapter) is None:
            jobs.append(j)
    if generated_core:
        # deferred: the generators need hypothesis, an optional dependency
        from tailproof.conformance.tools.generate import lockstep_trace

        for doc in _collect(lockstep_trace(["reference"]), generated_core, "gen-core"):
            jobs.append(_job(parse_trace(doc), GEN_CORE))
    for n, window, label in ((generated_connector, False, "gen-conn"),
                             (generated_window, True, "gen-conn-window")):
        strategy = _connector_strategy(window) if n else None
        if strategy is not None:
            for doc in _collect(strategy, n, label):
                jobs.append(_job(parse_trace(doc), GEN_CONN))
    for j in jobs:
        j.reference = observe(j, "reference")
    t1 = time.perf_counter()
    dropped: list[str] = []
    if baseline:
        kept = []
        for j in jobs:
            if observe(j, j.adapter) == j.reference:
                kept.append(j)
            else:
                dropped.append(j.name)
        jobs = kept
    return Workload(jobs, dropped, t1 - t0, time.perf_counter() - t1)
