"""The one JSON document ``check --json`` and ``replay --json`` print, and its JUnit view.

The document (schema: ``conformance/schema/report.schema.json``) names the tool and the vLLM
it ran against, the adapters run and those that were not (with why), every case's status,
the proofs' results, the findings about vLLM (kept apart from failures) and the timings.
"""

from __future__ import annotations

import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from tailproof import __version__
from tailproof.conformance.harness.replay import CaseResult

FORMAT = "tailproof-report/1"


def case_entry(r: CaseResult) -> dict[str, Any]:
    return {"name": r.name, "source": r.trace.source, "ops": len(r.trace.ops),
            "status": "diverged" if r.divergences else "agreed",
            "divergences": [d.as_json() for d in r.divergences],
            "skipped_ops": r.skipped(), "seconds": round(r.seconds, 4)}


def conformance_part(results: list[CaseResult], seconds: float) -> dict[str, Any]:
    """The conformance fields (the flat ``divergences`` list is every case's, in order)."""
    skipped: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        for a, names in r.skipped().items():
            skipped.setdefault(a, {})[r.name] = names
    return {
        "cases": len(results),
        "ops": sum(len(r.trace.ops) for r in results),
        "divergences": [d.as_json() for r in results for d in r.divergences],
        "skipped_ops": skipped,
        "seconds": round(seconds, 3),
        "results": [case_entry(r) for r in results],
    }


def proofs_part(report: dict[str, Any] | None, reason: str | None,
                failed: bool) -> dict[str, Any]:
    """The prover's properties and mutants; findings go to the top-level ``findings``."""
    if report is None:
        return {"status": "not_run", "reason": reason, "properties": [], "mutants": [],
                "seconds": 0.0}
    return {"status": "failed" if failed else "passed", "reason": None,
            "properties": report["properties"], "mutants": report["mutants"],
            "seconds": report.get("seconds", 0.0)}


def document(command: str, *, vllm: dict[str, Any], adapters: list[str],
             not_run: dict[str, str], strict_ids: bool, conformance: dict[str, Any],
             proofs: dict[str, Any], findings: list[dict[str, Any]], exit_code: int,
             total_seconds: float, mutation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report; ``mutation`` (``check --mutate``) adds the mutant score and its time."""
    result = "agreed"
    if conformance["divergences"]:
        result = "diverged"
    elif proofs["status"] == "failed":
        result = "proof_failed"
    elif mutation is not None and not mutation["passed"]:
        result = "mutation_below_min"
    timings = {"conformance_s": conformance["seconds"], "proofs_s": proofs["seconds"],
               "total_s": round(total_seconds, 3)}
    extra: dict[str, Any] = {}
    if mutation is not None:
        timings["mutation_s"] = mutation["seconds"]
        extra["mutation"] = mutation
    return {
        **_header(command, vllm),
        "adapters": adapters,
        "adapters_not_run": not_run,
        "strict_ids": strict_ids,
        **conformance,
        "proofs": proofs,
        "findings": findings,
        "timings": timings,
        **extra,
        "result": result,
        "exit_code": exit_code,
    }


def command_document(command: str, *, vllm: dict[str, Any], body: dict[str, Any],
                     result: str, exit_code: int, total_seconds: float) -> dict[str, Any]:
    """The ``--json`` document of a command that runs no conformance (``capture``,
    ``shrink``): the same header, result and exit code as :func:`document`, then the
    command's own fields under ``body`` (schema: ``conformance/schema/command.schema.json``)."""
    return {
        **_header(command, vllm),
        "body": body,
        "timings": {"total_s": round(total_seconds, 3)},
        "result": result,
        "exit_code": exit_code,
    }


def _header(command: str, vllm: dict[str, Any]) -> dict[str, Any]:
    """The fields every ``--json`` document starts with."""
    return {"format": FORMAT, "tool": {"name": "tailproof", "version": __version__},
            "command": command, "python": platform.python_version(), "vllm": vllm}


def write_junit(doc: dict[str, Any], path: Path) -> None:
    """JUnit XML: one test case per trace (a divergence is a failure) and per proof."""
    suites = ET.Element("testsuites", name="tailproof")
    conf = ET.SubElement(suites, "testsuite", name="conformance", tests=str(doc["cases"]),
                         failures=str(sum(r["status"] == "diverged" for r in doc["results"])),
                         time=str(doc["seconds"]))
    for r in doc["results"]:
        tc = ET.SubElement(conf, "testcase", classname="conformance", name=r["name"],
                           time=str(r["seconds"]))
        for d in r["divergences"][:1]:
            f = ET.SubElement(tc, "failure", message=(
                f"op {d['op_index']} ({d['op']}): {d['adapter']} vs {d['against']}"))
            f.text = f"expected {d['expected']}\ngot {d['got']}"
    proofs = doc["proofs"]
    ps = ET.SubElement(suites, "testsuite", name="proofs",
                       tests=str(len(proofs["properties"]) + len(proofs["mutants"])),
                       time=str(proofs["seconds"]))
    if proofs["status"] == "not_run":
        tc = ET.SubElement(ps, "testcase", classname="proofs", name="proofs")
        ET.SubElement(tc, "skipped", message=proofs["reason"] or "not run")
    for p in proofs["properties"]:
        tc = ET.SubElement(ps, "testcase", classname="proofs.properties", name=p["name"],
                           time=str(p["seconds"]))
        if not (p["result"] == "proved" or p["result"].startswith("holds")):
            ET.SubElement(tc, "failure", message=p["result"])
    for m in proofs["mutants"]:
        tc = ET.SubElement(ps, "testcase", classname="proofs.mutants", name=m["name"],
                           time=str(m["seconds"]))
        if not m["killed"]:
            ET.SubElement(tc, "failure", message="mutant survived")
    fs = ET.SubElement(suites, "testsuite", name="findings", tests=str(len(doc["findings"])))
    for f in doc["findings"]:
        tc = ET.SubElement(fs, "testcase", classname="findings", name=f["name"])
        out = ET.SubElement(tc, "system-out")
        out.text = f"{f['result']} {f.get('invariant') or ''}: {f.get('explanation', '')}"
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
