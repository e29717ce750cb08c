"""tailproof: partial-tail KV offload for hybrid (attention + Mamba) models, made provably right.

Parts: ``tailproof.spec`` (what must hold), ``tailproof.reference`` (what vLLM 0.33 does),
``tailproof.impl`` (the production connector), ``tailproof.conformance`` (traces and replay).
"""

__version__ = "0.1.0"
