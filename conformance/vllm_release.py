"""Where the vLLM releases conformance drives (0.33, 0.34) hand it different shapes: one named
switch per difference, read from vLLM's own classes (never from a version string), each citing
the vLLM function behind it in both releases. The connector's own switches are in
``tailproof.impl.vllm_release``; the adapters, the recorder and the capture engine use these.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator
from functools import cache
from typing import Any

from tailproof.impl.vllm_release import resumed_as_cached

__all__ = ["default_model_runner", "hash_map_entries", "model_runner_output",
           "mooncake_layout_module", "resumed_as_cached", "token_id_limit",
           "token_id_text"]

#: What 0.33 packs a token id into: its hasher and the reference use int64.
INT64_TOKEN_LIMIT = 1 << 63


def hash_map_entries(block_map: Any) -> Iterator[tuple[Any, list[int]]]:
    """Each cached key of a ``BlockPool.cached_block_hash_to_block`` with its block ids, the
    oldest first (the one ``get_one_block`` answers).

    vLLM 0.33 (``BlockHashToBlockMap``, ``v1/core/block_pool.py``): ``_cache`` maps a key to
    its ``KVCacheBlock``, or to a ``{block_id: KVCacheBlock}`` dict once several blocks share
    it. vLLM 0.34 (same class, rewritten): ``_cache`` maps a key to the *id* of its first
    block, and keys held by several blocks list every id, in insertion order, in ``_dup_ids``.
    """
    dups = getattr(block_map, "_dup_ids", None)
    if dups is not None:  # 0.34
        for key, first in block_map._cache.items():
            ids = dups.get(key)
            yield key, list(ids) if ids is not None else [first]
        return
    for key, val in block_map._cache.items():  # 0.33
        blocks = val.values() if isinstance(val, dict) else (val,)
        yield key, [b.block_id for b in blocks]


@cache
def _runner_output_indexed() -> bool:
    """Whether ``ModelRunnerOutput`` takes ``req_id_to_index``.

    vLLM 0.33 (``ModelRunnerOutput``, ``v1/outputs.py``): a required field that
    ``Scheduler.update_from_output`` reads each request's row from. vLLM 0.34: removed;
    ``update_from_output`` indexes by ``model_runner_output.req_ids`` (passing it raises).
    """
    from vllm.v1.outputs import ModelRunnerOutput  # deferred: vLLM is heavy

    return any(f.name == "req_id_to_index" for f in dataclasses.fields(ModelRunnerOutput))


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """A ``ModelRunnerOutput`` for ``req_ids`` in the release's shape
    (:func:`_runner_output_indexed`); ``fields`` go through as given."""
    from vllm.v1.outputs import ModelRunnerOutput  # deferred: vLLM is heavy

    if _runner_output_indexed():
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


@cache
def default_model_runner() -> str:
    """The worker order a simulated rank plays unless told otherwise: ``"v1"`` or ``"v2"``.

    vLLM 0.33: Model Runner V1 (``v1/worker/gpu_model_runner.py`` with
    ``KVConnectorModelRunnerMixin``) is the default and V2 (``v1/worker/gpu/``) opt-in
    (``VllmConfig.use_v2_model_runner``). vLLM 0.34: V1 is deleted and V2's
    ``ActiveKVConnector`` (``v1/worker/gpu/kv_connector.py``) is every runner's order.
    """
    return "v1" if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") else "v2"


@cache
def token_id_limit() -> int:
    """The first token id vLLM's ``Request`` cannot hold.

    vLLM 0.33 (``Request.__init__``, ``v1/request.py``): token ids are a Python list, hashed as
    int64 (``hash_block_tokens``): below 2^63. vLLM 0.34: ``prompt_token_ids`` and
    ``_all_token_ids`` are a ``TokenBuffer`` (``v1/token_buffer.py``, an ``array('i')``): an
    id past its item size raises ``OverflowError`` when the request is built.
    """
    if importlib.util.find_spec("vllm.v1.token_buffer") is None:
        return INT64_TOKEN_LIMIT
    from vllm.v1.token_buffer import TokenBuffer  # deferred: vLLM is heavy

    return 1 << (8 * TokenBuffer().itemsize - 1)


def token_id_text(limit: int) -> str:
    """``2^31`` for ``1 << 31``."""
    return f"2^{limit.bit_length() - 1}"


@cache
def mooncake_layout_module() -> str:
    """The module that holds Mooncake's ``PoolKey`` and store layouts.

    vLLM 0.33: ``mooncake/store/data.py`` (``PoolKey``, ``RankLocalStoreLayout``, and
    ``ChunkedTokenDatabase.key_for`` over them). vLLM 0.34: moved to ``mooncake/store/
    layout.py`` (``data.py`` re-imports only ``KeyMetadata`` and the layouts;
    ``ChunkedTokenDatabase.key_for`` is gone, ``db.store_layout.key_for`` remains, as in 0.33).
    """
    store = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
    layout = f"{store}.layout"
    return layout if importlib.util.find_spec(layout) is not None else f"{store}.data"
