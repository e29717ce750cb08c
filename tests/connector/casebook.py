"""Authoring tool for the connector corpus (``conformance/cases/conn_*.json``).

Each case is written as a short scheduler script: ``Case.step`` plays one engine step in
vLLM's order (running requests, then admissions with the connector lookup, then hand-off and
copy drains, the connector step, and the commits that ``_update_after_schedule`` does). The
script runs on vLLM 0.33 + Mooncake and on the reference in lockstep (block ids compared
exactly), and every observation of vLLM is recorded as the op's ``expect``.

Regenerate: ``.venv/bin/python tests/connector/casebook.py [NAME...]`` from the repo root.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tailproof.conformance.generate import Lockstep

CASES = Path(__file__).resolve().parents[2] / "conformance" / "cases"
FA, M = "full_attention", "mamba_align"
ADAPTERS = ["vllm-mooncake", "reference"]


def config(groups: list[tuple[str, int, bool]], h: int, num_blocks: int = 64,
           use_eagle: bool = False, **connector: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "groups": [{"kind": k, "block_size": b, **({"eagle": True} if e else {})}
                   for k, b, e in groups],
        "hash_block_size": h, "num_blocks": num_blocks}
    if use_eagle:
        doc["use_eagle"] = True
    doc["connector"] = {"role": "producer", **connector}
    return doc


class Case:
    def __init__(self, name: str, description: str, cfg: dict[str, Any]) -> None:
        self.name = name
        self.description = description
        self.run = Lockstep(cfg, ADAPTERS, strict=True)
        self.expects: list[Any] = []

    def op(self, name: str, **kw: Any) -> Any:
        obs = self.run.apply({"op": name, **kw})
        self.expects.append(obs)
        return obs

    def add(self, rid: str, tokens: list[Any], max_tokens: int = 16) -> Any:
        return self.op("add_request", rid=rid, tokens=tokens, max_tokens=max_tokens)

    def step(self, run: tuple[str, ...] = (), admit: tuple[str, ...] = (),
             finished: tuple[str, ...] = (), preempted: tuple[str, ...] = (),
             lookup_connector: bool = True, n: dict[str, int] | None = None,
             budget: int | None = None) -> dict[str, Any]:
        """One engine step; returns the conn_step observation."""
        n = n or {}
        self.op("new_step")
        ok: list[str] = []
        for rid in run:
            if rid in n:
                obs = self.op("allocate", rid=rid, n=n[rid])
            else:
                plan = self.op("plan_chunk", rid=rid, budget=budget)
                if not plan.get("chunk"):
                    continue
                obs = self.op("allocate", rid=rid, n="plan")
            if obs.get("ok"):
                ok.append(rid)
        for rid in admit:
            self.op("lookup", rid=rid)
            ext = 0
            if lookup_connector:
                res = self.op("sched_lookup", rid=rid)
                ext = res.get("external", 0) or 0
            self.op("plan_chunk", rid=rid, use_hit=True, external=ext, budget=budget)
            obs = self.op("allocate", rid=rid, n="plan", use_hit=True, external=ext)
            if obs.get("ok"):
                ok.append(rid)
        self.op("drain_offloads")
        copies = self.op("drain_copies")
        if copies.get("handle") is not None:
            self.op("release_retained")
        obs = self.op("conn_step", finished=list(finished), preempted=list(preempted))
        for rid in ok:
            self.op("commit", rid=rid)
        return obs

    def doc(self) -> dict[str, Any]:
        ops = []
        for op, exp in zip(self.run.ops, self.expects, strict=True):
            ops.append({**op, "expect": exp} if exp is not None else dict(op))
        return {"format": "tailproof-trace/1", "name": self.name,
                "description": self.description, "config": self.run.config_doc, "ops": ops}

    def write(self) -> Path:
        path = CASES / f"{self.name}.json"
        path.write_text(json.dumps(self.doc(), indent=1) + "\n")
        return path


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cases_conn

    for build in cases_conn.ALL:
        case = build()
        if argv and case.name not in argv:
            continue
        print("wrote", case.write())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
