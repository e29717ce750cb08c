"""Model Runner V2 end to end on a lent GPU: vLLM 0.33's real engine with the test-bed model on
CUDA (``TAILPROOF_TESTBED=model``: the model only, vLLM's own CUDA platform and attention
backend), ``VLLM_USE_V2_MODEL_RUNNER=1``, ``TailproofConnector`` on the memory store.

Runs the real-engine oracle's passes (cold, warm, store-hit, after-reset) against an engine
with prefix caching off, on the same GPU, and writes one JSON verdict: which model runner ran,
what it registered with the connector, each pass's differences and cached tokens, the
connector's counters. Exit 0 when every pass equals the truth and the store-hit pass was served
from the store, 1 otherwise. ``--cpu`` runs the same on the CPU test bed (0.33: V1; 0.34: the
standalone CPU V2), to check the script itself where there is no GPU.

    .venv/bin/python scripts/device_v2_e2e.py --out out/device/v2-e2e.json [--cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine import oracle

GPU_ENV = {"TAILPROOF_TESTBED": "model", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def runner_kind(worker: Any) -> str:
    """The model runner class this worker runs (V2 lives in ``vllm.v1.worker.gpu``)."""
    r = worker.model_runner
    return f"{type(r).__module__}.{type(r).__qualname__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON verdict's file")
    ap.add_argument("--cpu", action="store_true", help="the CPU test bed (no GPU)")
    ap.add_argument("--max-tokens", type=int, default=oracle.MAX_TOKENS)
    args = ap.parse_args(argv)
    env = {} if args.cpu else GPU_ENV
    prompts = oracle.shared_prefix_prompts()
    verdict: dict[str, Any] = {"env": env, "passes": {}}
    with tb.Bed(tb.EngineSpec(prefix_caching=False, env=env)) as truth_bed:
        truth = [list(c.tokens) for c in truth_bed.generate(prompts, args.max_tokens)]
    spec = tb.EngineSpec(env=env, kv_transfer_config=tb.memory_connector("device-v2"))
    ok = True
    with tb.Bed(spec) as bed:
        verdict["model_runner"] = bed.worker(runner_kind)
        verdict["registered"] = bed.worker(tb.registered_kv_caches)
        for name in oracle.PASSES:
            if name == "store-hit":
                bed.reset_prefix_cache()
            elif name == "after-reset":
                bed.reset_prefix_cache(reset_connector=True)
            res = oracle.compare(truth, bed.generate(prompts, args.max_tokens), name)
            served = any(res.cached_tokens)
            verdict["passes"][name] = {"differences": res.differences,
                                       "cached_tokens": res.cached_tokens}
            ok = ok and not res.differences and (served or name != "store-hit")
        verdict["connector"] = bed.worker(tb.connector_counters)
    verdict["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(verdict, f, indent=1, default=str)
    print(f"v2 end to end: {'ok' if ok else 'FAILED'} ({verdict['model_runner']})",
          file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
