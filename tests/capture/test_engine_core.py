"""The recorder in vLLM's own ``EngineCore`` on CPU, switched on only by the environment.

``EngineCore`` loads the ``vllm.general_plugins`` entry points (our recorder plugin) and
builds its scheduler itself; the executor is ``sim_executor`` (a worker that only samples:
no model can run on CPU here). The captured trace must replay with no divergence on the
reference model and on vLLM's own ``KVCacheManager``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import Request
    from tailproof.conformance.tools.capture_engine import tiny_hybrid
    import sim_executor

    tiny_hybrid.register()
    model = ModelConfig(model=str(tiny_hybrid.MODEL_DIR), skip_tokenizer_init=True,
                        dtype="float32", max_model_len=1024)
    # Dense Mamba checkpoint retention: the trace format does not model vLLM's sparse
    # retention (the engine default, prefix_cache_retention_interval=0).
    cache = CacheConfig(block_size=16, enable_prefix_caching=True, mamba_cache_mode="align",
                        prefix_match_unit=4, prefix_cache_retention_interval=None)
    sched = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024,
                            is_encoder_decoder=False, scheduler_reserve_full_isl=False,
                            async_scheduling=False)
    vc = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig("cpu"),
                    scheduler_config=sched)
    # A GPU platform enables the hybrid KV cache manager (needed by hybrid models); the
    # Unspecified platform of a CPU-only machine turns it off in VllmConfig's validation.
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    core = EngineCore(vc, sim_executor.executor_class(), log_stats=False)
    assert getattr(core.scheduler, "_tailproof_recorder", None) is not None, "not recording"
    system = list(range(100, 145))
    for turn in range(3):
        for i in range(3):
            sp = SamplingParams(max_tokens=3 + i, ignore_eos=True)
            sp.update_from_generation_config({{}}, eos_token_id=2)
            req = Request(f"t{{turn}}r{{i}}", system + [7 + i] * (5 + turn * 6),
                          sampling_params=sp, pooling_params=None,
                          block_hasher=core.request_block_hasher)
            core.add_request(req)
        for _ in range(200):
            if not core.scheduler.has_requests():
                break
            core.step()
    try:
        core.shutdown()  # executor, then scheduler (closes the trace), then device cleanup
    except RuntimeError as e:  # the device cleanup needs an accelerator; none here
        assert "accelerator" in str(e), e
    print("ok")
""")


def test_recorder_in_engine_core(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    env = {"TAILPROOF_RECORD": str(out), "PATH": "/usr/bin:/bin",
           "VLLM_LOGGING_LEVEL": "ERROR", "HOME": str(tmp_path),
           # the release this process runs (scripts/vllm_env.sh: an overlay for 0.33)
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(here=str(HERE))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["provenance"]["vllm"] == vllm.__version__
    assert doc["provenance"]["recorder"] == "tailproof-recorder/2"
    assert doc["config"]["groups"][0]["kind"] == "full_attention"
    assert any(op["op"] == "lookup" and op["expect"]["hit"] > 0 for op in doc["ops"])
    from tailproof.conformance.format.trace import load_trace
    from tailproof.conformance.harness.replay import run_trace

    result = run_trace(load_trace(out), ["reference", "vllm"], strict=True)
    assert result.divergences == []
    assert len(doc["ops"]) > 100
