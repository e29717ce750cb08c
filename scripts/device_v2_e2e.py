"""Model Runner V2 end to end on a lent GPU: the installed vLLM release's real engine with the
test-bed model on CUDA (``TAILPROOF_TESTBED=model``: the model only, vLLM's own CUDA platform and
attention backend), ``TailproofConnector`` on the memory store.

* vLLM 0.33: ``VLLM_USE_V2_MODEL_RUNNER=1`` (V1 is still its CPU and fallback runner).
* vLLM 0.34: Model Runner V2 is the only runner, and the extensible KV cache is the default on
  CUDA (``VllmConfig._resolve_extensible_kv_cache``, ``config/vllm.py``) unless
  ``kv_cache_memory_bytes`` is set, which the bed sets: the GPU run unsets it, sizes the cache by
  ``gpu_memory_utilization`` and asks for the extensible cache explicitly, so that the connector
  is built after warmup against the committed views (``extend_kv_cache``,
  ``v1/worker/extensible_kv_cache.py``) or the engine says why it cannot.

Runs the real-engine oracle's passes (cold, warm, store-hit, after-reset) against an engine
with prefix caching off, on the same GPU, and writes one JSON verdict: the release, which model
runner ran, the KV cache it used, what it registered with the connector, each pass's
differences and cached tokens, the connector's counters; on a failure, the error. Exit 0 when
every pass equals the truth and the store-hit pass was served from the store, 1 otherwise.
``--cpu`` runs the same on the CPU test bed, where there is no GPU. ``--plan`` starts no engine:
it imports what the run imports (the release, Model Runner V2's module, the connector, the
model) and builds both engines' ``EngineArgs``, to prove the set-up on a machine without a GPU
(``scripts/device_check.sh`` there).

    python scripts/device_v2_e2e.py --out out/device/v2-e2e.json [--cpu | --plan]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

TESTBED_MODEL = {"TAILPROOF_TESTBED": "model"}
#: 0.34 on a GPU: the KV cache sized from measured memory (a small share of the H200's
#: 139 GiB is plenty for the tiny model), extensible, so the connector is built after warmup
EXTENSIBLE = {"kv_cache_memory_bytes": None, "enable_extensible_kv_cache": True,
              "gpu_memory_utilization": 0.05}
#: modules a GPU run imports beyond the bed's own: the release's Model Runner V2 (0.33 and
#: 0.34) and, on 0.34, the extensible KV cache
PLAN_IMPORTS = ("vllm.v1.worker.gpu.model_runner", "tailproof.impl.connector",
                "tailproof.conformance.realengine.model")


def release() -> tuple[int, int]:
    """(major, minor) of the vLLM this process would import (its dist-info first on the path)."""
    major, minor = importlib.metadata.version("vllm").split(".")[:2]
    return int(major), int(minor)


def gpu_setup(rel: tuple[int, int]) -> tuple[dict[str, str], dict[str, Any]]:
    """The bed's extra environment and engine arguments for a GPU run of release ``rel``."""
    if rel >= (0, 34):
        return dict(TESTBED_MODEL), dict(EXTENSIBLE)
    return {**TESTBED_MODEL, "VLLM_USE_V2_MODEL_RUNNER": "1"}, {}


def runner_kind(worker: Any) -> str:
    """The model runner class this worker runs (V2 lives in ``vllm.v1.worker.gpu``)."""
    r = worker.model_runner
    return f"{type(r).__module__}.{type(r).__qualname__}"


def kv_cache_facts(worker: Any) -> dict[str, Any]:
    """The KV cache the worker built: extensible or not (0.34), blocks, device."""
    cc = worker.vllm_config.cache_config
    return {"extensible": getattr(cc, "enable_extensible_kv_cache", None),
            "num_gpu_blocks": cc.num_gpu_blocks,
            "device": str(getattr(worker, "device", "?"))}


def plan(specs: dict[str, tb.EngineSpec], rel: tuple[int, int]) -> dict[str, Any]:
    """Import what a run imports and build each engine's ``EngineArgs``; no engine starts."""
    from vllm.engine.arg_utils import EngineArgs

    from tailproof.conformance.realengine.model import write_model_dir

    mods = PLAN_IMPORTS + (("vllm.v1.worker.extensible_kv_cache",) if rel >= (0, 34) else ())
    for m in mods:
        importlib.import_module(m)
    out: dict[str, Any] = {"imports": list(mods)}
    # The model reaches vLLM only through the project's entry point (an installed dist-info):
    # load vLLM's general plugins as an engine process does and look the architecture up.
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from tailproof.conformance.realengine.model import ARCH

    os.environ.update(TESTBED_MODEL)
    load_general_plugins()
    if ARCH not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"the test-bed model {ARCH} is not registered: is tailproof's "
                           "vllm.general_plugins entry point installed?")
    out["model_registered"] = ARCH
    with tempfile.TemporaryDirectory(prefix="tailproof-plan-") as d:
        write_model_dir(d)
        for name, spec in specs.items():
            kw = spec.llm_kwargs(d)
            EngineArgs(**kw)
            out[name] = {"env": spec.env, "engine_args": {k: v for k, v in kw.items()
                                                          if k != "model"}}
    return out


def run(specs: dict[str, tb.EngineSpec], max_tokens: int, verdict: dict[str, Any]) -> bool:
    """The truth engine, then the connector engine's four passes; fills ``verdict``."""
    prompts = oracle.shared_prefix_prompts()
    t0 = time.monotonic()
    truth = oracle.ground_truth(prompts, max_tokens, specs["truth"])
    verdict["seconds_truth"] = round(time.monotonic() - t0, 1)
    ok = True
    t0 = time.monotonic()
    with tb.Bed(specs["connector"]) as bed:
        verdict["model_runner"] = bed.worker(runner_kind)
        verdict["kv_cache"] = bed.worker(kv_cache_facts)
        verdict["registered"] = bed.worker(tb.registered_kv_caches)
        got = oracle.run_passes(bed, prompts, max_tokens)
        for name in oracle.PASSES:
            res = oracle.compare(truth, got[name], name)
            served = any(res.cached_tokens)
            verdict["passes"][name] = {"differences": res.differences,
                                       "cached_tokens": res.cached_tokens}
            ok = ok and res.ok and (served or name != "store-hit")
        verdict["connector"] = bed.worker(tb.connector_counters)
    verdict["seconds_connector"] = round(time.monotonic() - t0, 1)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON verdict's file")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="the CPU test bed, no GPU")
    mode.add_argument("--plan", action="store_true",
                      help="imports and engine arguments only, no engine (no GPU needed)")
    ap.add_argument("--max-tokens", type=int, default=oracle.MAX_TOKENS)
    args = ap.parse_args(argv)
    rel = release()
    env, engine_args = ({}, {}) if args.cpu else gpu_setup(rel)
    specs = {
        "truth": tb.EngineSpec(prefix_caching=False, env=env, engine_args=engine_args),
        "connector": tb.EngineSpec(env=env, engine_args=engine_args,
                                   kv_transfer_config=tb.memory_connector("device-v2")),
    }
    verdict: dict[str, Any] = {"vllm": importlib.metadata.version("vllm"), "env": env,
                               "engine_args": engine_args, "passes": {}}
    ok = False
    try:
        if args.plan:
            verdict["plan"] = plan(specs, rel)
            ok = True
        else:
            ok = run(specs, args.max_tokens, verdict)
    except Exception as e:  # the verdict records it; one line on stderr says what failed
        verdict["error"] = traceback.format_exc()[-8000:]
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        verdict["error_line"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
    verdict["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(verdict, f, indent=1, default=str)
    what = "plan" if args.plan else f"v2 end to end ({verdict.get('model_runner', '?')})"
    tail = "" if ok else f": {verdict.get('error_line', 'a pass differs from the truth')}"
    print(f"vLLM {verdict['vllm']} {what}: {'ok' if ok else 'FAILED'}{tail}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
