"""The test bed's two vLLM entry points, light on purpose: vLLM loads them in every engine
process, so they import nothing unless ``TAILPROOF_TESTBED=1`` asks for the test bed.

* ``vllm.platform_plugins``: :func:`activate` names ``platform.TestBedPlatform`` (vLLM resolves
  the qualname itself, ``resolve_current_platform_cls_qualname``);
* ``vllm.general_plugins``: :func:`register_model` registers the tiny hybrid model.
"""

from __future__ import annotations

import os

ENV = "TAILPROOF_TESTBED"
PLATFORM = "tailproof.conformance.realengine.platform.TestBedPlatform"


def enabled() -> bool:
    """Whether this process asked for the test bed (its CPU platform and its model)."""
    return os.environ.get(ENV) == "1"


def model_enabled() -> bool:
    """Whether this process asked for the test-bed model: with the bed, or alone
    (``TAILPROOF_TESTBED=model``: the model on vLLM's own platform, e.g. a GPU's, as
    ``scripts/device_v2_e2e.py`` runs it)."""
    return enabled() or os.environ.get(ENV) == "model"


def activate() -> str | None:
    """The platform's qualname under the test bed, else None (the plugin stays inactive)."""
    return PLATFORM if enabled() else None


def register_model() -> None:
    """Register the test-bed model with vLLM's ``ModelRegistry`` (test bed only, idempotent)."""
    if not model_enabled():
        return
    from vllm import ModelRegistry

    # deferred: vLLM loads this plugin in every process; the model imports torch and vLLM
    from tailproof.conformance.realengine.model import ARCH, TailproofTestBedHybridForCausalLM

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, TailproofTestBedHybridForCausalLM)
