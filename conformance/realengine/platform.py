"""The test-bed vLLM platform: vLLM's own ``CpuPlatform`` with the CUDA wheel's gaps filled.

Named by ``plugins.activate`` (entry-point group ``vllm.platform_plugins``), which vLLM calls
in every process while resolving ``current_platform``
(``resolve_current_platform_cls_qualname``, ``vllm/platforms/__init__.py``); it answers only
when ``TAILPROOF_TESTBED=1`` is set (the test bed sets it), so a user's engine never sees it.
``VLLM_TARGET_DEVICE=cpu`` would not do: it picks the built-in ``CpuPlatform`` and skips plugins.

The engine runs unchanged otherwise: vLLM's ``CPUWorker`` and the model runner it builds, its
allocation, Mamba align-mode copies and connector plumbing. On vLLM 0.33 that runner is
``CPUModelRunner`` (the V1 ``GPUModelRunner``); on 0.34, where V1 is deleted, it is the
standalone, Triton-free Model Runner V2 (``StandaloneCPUModelRunner``), which this platform
asks for (``release.standalone_cpu_runner``).
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

from tailproof.conformance.realengine import release

ATTN_BACKEND = "tailproof.conformance.realengine.attention.TorchPagedAttentionBackend"


class TestBedPlatform(CpuPlatform):
    """``CpuPlatform`` plus pure-torch native ops, a plain-torch attention backend, the
    standalone CPU runner where vLLM has one, and the executor the caller chose."""

    @classmethod
    def import_kernels(cls) -> None:
        """Register the ``_C`` ops this path calls (``ops``); the wheel has no CPU kernels."""
        # deferred: torch, and vLLM calls this once its platform is chosen
        from tailproof.conformance.realengine import ops

        ops.register()

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        """Yes: the runner that needs no Triton (0.34 ``CPUWorker.init_device`` and
        ``Worker.__init__``'s Triton check ask this; 0.33 never does)."""
        return True

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any,
                             num_heads: int | None = None) -> str:
        """The plain-torch paged backend (vLLM's ``CPU_ATTN`` needs native kernels)."""
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("test-bed platform: no MLA or sparse attention")
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, ATTN_BACKEND)
        return ATTN_BACKEND

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """``CpuPlatform.check_and_update_config``, keeping ``distributed_executor_backend``
        (the parent turns ``uni`` into ``mp`` whenever the engine core runs in its own process,
        ``platforms/cpu.py``, which would hide which executor a test asked for), and with its
        x86 Triton refusal answered for the standalone runner
        (``release.triton_check_answered_by_standalone_runner``)."""
        par = vllm_config.parallel_config
        asked = par.distributed_executor_backend
        with release.triton_check_answered_by_standalone_runner():
            super().check_and_update_config(vllm_config)
        if asked is not None:
            par.distributed_executor_backend = asked
