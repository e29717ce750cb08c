"""``tailproof smoke``: a deployment's connector configuration checked in vLLM's real engine.

Starts vLLM's real engine on CPU (the installed release, 0.33 or 0.34; the test bed: ``bed``,
``model``) with the user's ``kv_transfer_config`` (their store, their namespace), runs the four
passes of :mod:`.oracle` (cold, warm, store-hit, after-reset) and compares each pass's greedy tokens
with
an engine without prefix caching. A pass fails when its tokens differ, and the store-hit pass
also fails when no prompt token came from the store or a load failed (a corrupted or
unreadable value is recomputed, so the tokens stay right, but the store is not serving).

The engine is the tiny test-bed model, so its keys (the layout fingerprint names the model)
never collide with a real model's entries in a shared store.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tailproof.conformance.harness.errors import UsageError
from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

CONNECTOR = "TailproofConnector"
#: test-only: called as ``hook(bed, pass_name)`` right before that pass (e.g. to corrupt the
#: store before "store-hit"); empty in normal use
PASS_HOOKS: dict[str, oracle.PassHook] = {}
#: the workload: fewer prompts than the test suite's, same shapes (sub-block hits included)
SMOKE_PREFIX_LENGTHS = (40, 64, 150, 288, 400)
_FAIL_PREFIXES = ("verify_fail", "load_failures", "get_fail_error", "get_fail_timeout")
#: ground truths computed in this process (the engine without prefix caching is deterministic
#: for a workload; repeated checks in one process, e.g. the tests, start it once)
_TRUTHS: dict[tuple[tuple[tuple[int, ...], ...], int], list[tuple[int, ...]]] = {}


def parse_config(text: str) -> dict[str, Any]:
    """``--kv-transfer-config``: a JSON object (or ``@file``) naming ``TailproofConnector``."""
    src = "--kv-transfer-config"
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as e:
            raise UsageError(f"{src}: cannot read {path}: {e.strerror}",
                             "give a readable JSON file after @") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{src}: not JSON ({e.msg} at line {e.lineno} column {e.colno})",
                         "pass a JSON object, e.g. '{\"kv_connector\": \"TailproofConnector\", "
                         "...}'") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{src}: expected a JSON object, got {type(cfg).__name__}",
                         "pass the object vLLM's --kv-transfer-config takes")
    if cfg.get("kv_connector") != CONNECTOR:
        raise UsageError(f"{src}: kv_connector is {cfg.get('kv_connector')!r}, not {CONNECTOR!r}",
                         f'set "kv_connector": "{CONNECTOR}"')
    cfg.setdefault("kv_connector_module_path", "tailproof.impl.connector")
    cfg.setdefault("kv_role", "kv_both")
    extra = cfg.setdefault("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise UsageError(f"{src}: kv_connector_extra_config must be an object",
                         "give the connector's keys as a JSON object")
    from tailproof.impl.config import ConfigError, parse_settings

    try:
        parse_settings(extra, cfg["kv_role"])
    except ConfigError as e:
        raise UsageError(f"{src}: " + "; ".join(e.problems),
                         "correct kv_connector_extra_config (docs/deploy.md, \"Flags\")") from None
    return cfg


def _load_failures(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()
            if k.startswith(_FAIL_PREFIXES) and v > before.get(k, 0)}


def _start_error(e: tb.BedError) -> UsageError | None:
    """The connector's start-up refusal (a config error) as one line, else None."""
    text = str(e)
    if "invalid TailproofConnector configuration" not in text:
        return None
    problems = re.findall(r"^\s+- (.+)$", text.split("invalid TailproofConnector configuration",
                                                     1)[1], flags=re.M)
    return UsageError("the connector refused to start in vLLM: " + "; ".join(problems[:4]),
                      "correct --kv-transfer-config (docs/deploy.md, \"Flags\")")


def run(ktc: dict[str, Any], *, max_tokens: int = oracle.MAX_TOKENS,
        prompts: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Run the check; the verdict: ``ok``, ``failed_pass`` (the first failing pass or None),
    ``passes`` (per pass: ok, problems, cached tokens), ``connector`` counters, timings."""
    prompts = [list(p) for p in (prompts or oracle.shared_prefix_prompts(
        seed=1, lengths=SMOKE_PREFIX_LENGTHS))]
    t0 = time.monotonic()
    key = (tuple(map(tuple, prompts)), max_tokens)
    if key not in _TRUTHS:
        _TRUTHS[key] = oracle.ground_truth(prompts, max_tokens)
    truth = _TRUTHS[key]
    t_truth = time.monotonic() - t0
    spec = tb.EngineSpec(kv_transfer_config=ktc, max_num_batched_tokens=256)
    passes: list[dict[str, Any]] = []
    try:
        bed = tb.Bed(spec)
    except tb.BedError as e:
        err = _start_error(e)
        if err is not None:
            raise err from None
        raise
    with bed:
        for name in oracle.PASSES:
            if name == "store-hit":
                bed.reset_prefix_cache()
            elif name == "after-reset":
                bed.reset_prefix_cache(reset_connector=True)
            if name in PASS_HOOKS:
                PASS_HOOKS[name](bed, name)
            (before,) = bed.worker(tb.connector_counters)
            got = bed.generate(prompts, max_tokens)
            (after,) = bed.worker(tb.connector_counters)
            res = oracle.compare(truth, got, name)
            problems = list(res.differences)
            failures = _load_failures(before, after)
            if name == "store-hit":
                if not any(res.cached_tokens):
                    problems.append("no prompt token was served from the store after the "
                                    "device prefix cache was reset")
                if failures:
                    problems.append("loads failed and were recomputed: " + ", ".join(
                        f"{k}={v}" for k, v in sorted(failures.items())))
            passes.append({"name": name, "ok": not problems, "problems": problems,
                           "cached_tokens": res.cached_tokens, "load_failures": failures})
        (counters,) = bed.worker(tb.connector_counters)
    failed = next((p["name"] for p in passes if not p["ok"]), None)
    return {"ok": failed is None, "failed_pass": failed, "passes": passes,
            "prompts": len(prompts), "max_tokens": max_tokens, "connector": counters,
            "truth_s": round(t_truth, 1), "total_s": round(time.monotonic() - t0, 1)}


def render(v: dict[str, Any]) -> str:
    """The verdict for a terminal."""
    lines = []
    for p in v["passes"]:
        hit = sum(p["cached_tokens"])
        lines.append(f"  {p['name']:<12} {'ok' if p['ok'] else 'FAIL'}  "
                     f"({hit} prompt tokens cached over {len(p['cached_tokens'])} prompts)")
        lines += [f"      {x}" for x in p["problems"][:5]]
    head = ("smoke: PASS: every pass equals the engine without prefix caching" if v["ok"] else
            f"smoke: FAIL in pass {v['failed_pass']!r}")
    return "\n".join([head, *lines])
