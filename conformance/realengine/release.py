"""Where the test bed meets vLLM 0.33 and 0.34 differently: one named switch per difference,
read from vLLM's own modules (never from a version string), each citing the vLLM function
behind it in both releases.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib.util import find_spec
from typing import Any

#: 0.33's V1 runner (``CPUModelRunner`` subclasses it); absent from 0.34
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


@cache
def standalone_cpu_runner() -> bool:
    """Whether vLLM's CPU worker can run the standalone, Triton-free Model Runner V2.

    vLLM 0.34 (``CPUWorker.init_device``, ``v1/worker/cpu_worker.py``): builds
    ``StandaloneCPUModelRunner`` (``v1/worker/cpu/standalone_model_runner.py``) when
    ``current_platform.uses_standalone_cpu_model_runner()``, else the Triton MRV2
    ``CPUModelRunner``; Model Runner V1 is deleted. vLLM 0.33: no such runner; ``CPUWorker``
    builds ``CPUModelRunner``, a subclass of the V1 ``GPUModelRunner``.
    """
    return find_spec("vllm.v1.worker.cpu.standalone_model_runner") is not None


@contextmanager
def triton_check_answered_by_standalone_runner() -> Iterator[None]:
    """Around ``CpuPlatform.check_and_update_config``: its Triton refusal, answered for the
    runner the test bed really runs.

    vLLM 0.34 (``CpuPlatform.check_and_update_config``, ``platforms/cpu.py``) raises "vLLM on x86
    CPUs requires Triton (triton-cpu)" because on x86 the worker would build the Triton runner
    ("Non-x86 CPUs without Triton use the standalone CPU model runner"). The test bed builds the
    standalone runner on x86 (``TestBedPlatform.uses_standalone_cpu_model_runner``), which needs
    no Triton, so for that one call the check reads ``HAS_TRITON`` as true. Nothing else reads
    the flag during the call: the method imports it in its body, and no module is first
    imported during the call (the modules that test the flag at import time are loaded by
    then); it is restored after. vLLM 0.33 only warns there ("triton-cpu is expected on x86
    CPUs"): left as it is.
    """
    if not standalone_cpu_runner():
        yield
        return
    import vllm.triton_utils as triton_utils  # deferred: vLLM resolves its platform first

    saved = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = saved


def runner_kv_caches_by_layer(runner: Any) -> dict[str, Any]:
    """The tensor per layer the runner handed ``register_kv_caches``, by layer name.

    vLLM 0.33 Model Runner V1 (``GPUModelRunner.initialize_kv_cache``, ``bind_kv_cache``,
    ``v1/worker/utils.py``): ``runner.kv_caches`` lists the layers' tensors in layer-index order.
    Model Runner V2, 0.33 and 0.34 (``GPUModelRunner.initialize_kv_cache``,
    ``v1/worker/gpu/model_runner.py``; 0.34's ``StandaloneCPUModelRunner.initialize_kv_cache``):
    the connector gets ``init_kv_cache``'s dict and ``runner.kv_caches`` keeps its values in the
    dict's order, which is ``allocate_kv_cache``'s (``v1/worker/utils.py``): the config's
    ``kv_cache_tensors``, each tensor's ``layers`` in turn. 0.34's GPU runner also keeps the dict
    itself (``kv_caches_by_layer``).
    """
    by_layer = getattr(runner, "kv_caches_by_layer", None)
    if by_layer:
        return dict(by_layer)
    config = runner.kv_cache_config
    if any(c.__module__ == V1_RUNNER_MODULE for c in type(runner).__mro__):
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted((n for g in config.kv_cache_groups for n in g.layer_names),
                       key=extract_layer_index)
    else:
        names = [n for t in config.kv_cache_tensors for n in t.layers]
    return dict(zip(names, runner.kv_caches, strict=True))


@cache
def inflight_kv_load_cap() -> bool:
    """Whether the engine takes ``--max-num-inflight-kv-loads`` (a cap on asynchronous KV loads
    holding blocks before their requests run, and the connector's ``may_load_async``).

    vLLM 0.34 (``SchedulerConfig.max_num_inflight_kv_loads``, ``config/scheduler.py``;
    ``Scheduler._admits_inflight_kv_load`` and ``_enqueue_waiting_request``,
    ``v1/core/sched/scheduler.py``): loads past the cap wait in ``async_kv_waiting``, and an
    aborted request's load in flight keeps its slot (``_aborted_kv_loads``) until the connector
    reports it. vLLM 0.33: no such setting; every load the scheduler admits starts at once.
    """
    import dataclasses

    from vllm.config.scheduler import SchedulerConfig  # deferred: vLLM is heavy

    return any(f.name == "max_num_inflight_kv_loads" for f in dataclasses.fields(SchedulerConfig))


@cache
def block_copy_covers_every_view() -> bool:
    """Whether vLLM's copy-on-write block copy copies every view of a shared allocation, asked of
    vLLM's own function on a two-block buffer seen through a short and a full page view at one
    address (a Mamba state view and the attention view it shares a page with).

    vLLM 0.33 (``copy_kv_cache_blocks_inplace``, ``v1/worker/utils.py``): views deduplicated by
    ``(device, data_ptr)``, so only the first one is copied: when a Mamba view comes first, the
    attention K/V beyond its state bytes stays stale (docs/history.md). vLLM 0.34 (same
    function): the key adds shape, strides and element size, and both views are copied.
    """
    import torch
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    page = 8
    buf = torch.zeros(3 * page, dtype=torch.int8)  # more than the blocks: a per-view copy
    full = buf[: 2 * page].view(2, page)
    short = full[:, : page // 2]
    full[0] = torch.arange(1, page + 1, dtype=torch.int8)
    copy_kv_cache_blocks_inplace([short, full], 2, [(0, 1)])
    return bool(full[1].equal(full[0]))
