"""Stated bounds on what a trace may ask for, checked by the loader before anything runs.

Every number a trace carries ends up as a loop bound, a tensor size or an int64 somewhere in
an adapter; without bounds a typo (``num_blocks: 1000000000``, ``{"range": [0, 1e12]}``)
hangs or exhausts memory instead of failing with a line naming the field. The limits are
documented in docs/trace-format.md ("Limits"); each one is far above what the corpus uses.
"""

from __future__ import annotations

from typing import Any

#: largest trace file read (bytes)
MAX_FILE_BYTES = 16 << 20
#: longest a pipe or FIFO trace may take to be written in full (seconds; trace_file.py)
MAX_PIPE_SECONDS = 10.0
#: deepest nesting of arrays/objects anywhere in a trace
MAX_DEPTH = 32
#: most ops in one trace
MAX_OPS = 100_000
#: token ids are packed as int64 by the reference and by vLLM's hasher
TOKEN_ID_LIMIT = 1 << 63
#: most tokens a single token list may expand to, and all of a trace's lists together
MAX_TOKENS_PER_LIST = 1 << 20
MAX_TOKENS_PER_TRACE = 1 << 22
#: pool size including the null block
MAX_NUM_BLOCKS = 1 << 16
#: tokens per block of one group, and h
MAX_BLOCK_SIZE = 1 << 16
#: num_blocks * the largest block size: the KV slots the impl adapter allocates per layer
MAX_POOL_TOKENS = 1 << 22
#: max_model_len, the token budget and every token count an op carries (n, external, ...)
MAX_TOKEN_COUNT = 1 << 22
#: most KV cache groups
MAX_GROUPS = 16
#: longest request id
MAX_RID_LEN = 256


def depth_problem(doc: Any) -> str | None:
    """Whether ``doc`` nests deeper than MAX_DEPTH (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = list(v.values())
        elif isinstance(v, list):
            items = v
        else:
            continue
        if d > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        stack.extend((x, d + 1) for x in items)
    return None
