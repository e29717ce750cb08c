"""Pure-Python reference model of vLLM 0.33's scheduler-side KV block lifecycle.

Modules, each with one job (read top to bottom in this order):
``geometry`` (static configuration), ``hashing`` (prefix hash chain), ``request``,
``block_pool`` (blocks, free queue, key maps), ``managers`` (full attention / Mamba align
tables), ``coordinator`` (joint hybrid hit and per-group fan-out), ``kv_manager`` (the
``KVCacheManager`` facade) and ``scheduler_split`` (the Mamba-aligned chunk split).
Imports neither vLLM nor torch.
"""

from tailproof.reference.geometry import Geometry, GroupSpec
from tailproof.reference.kv_manager import KVCacheManager
from tailproof.reference.request import Request, RequestStatus
from tailproof.reference.scheduler_split import mamba_block_aligned_split, plan_chunk

__all__ = [
    "Geometry",
    "GroupSpec",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "mamba_block_aligned_split",
    "plan_chunk",
]
