"""The vLLM 0.33 core backend class, imported only by ``@pytest.mark.vllm`` tests."""

from __future__ import annotations


def vllm_backend_class():  # noqa: ANN201
    from tailproof.conformance.harness.adapters.vllm_core import VllmCoreBackend

    return VllmCoreBackend
