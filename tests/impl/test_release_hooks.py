"""The connector hooks vLLM 0.34 added (``may_load_async``, ``kv_cache_access``,
``supports_lookahead_block_hashes``) and the release switches of ``impl/vllm_release.py``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.lookup import LookupResult
from tailproof.impl.scheduler_side import SchedulerSide


def _side(**settings: object) -> SchedulerSide:
    g = StoreGeometry(core_group_ids=(0, 1), block_sizes=(16, 16), is_mamba=(False, True),
                      hash_block_size=4, scheduler_block_size=16, partial_hits=True,
                      use_eagle=False, eagle_group_ids=frozenset(), num_blocks=64)
    return SchedulerSide(replace(Settings(), **settings), g, None, 1)


class _Lookups:
    """A lookup client answering a fixed hit length, counting asks."""

    def __init__(self, hit: int, fail: bool = False) -> None:
        self.hit, self.fail, self.asks = hit, fail, 0

    def lookup(self, n: int, hashes: object) -> LookupResult:
        self.asks += 1
        if self.fail:
            raise ConnectionError("store down")
        return LookupResult(self.hit)


def _req(rid: str = "r", n: int = 45) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_tokens=n, block_hashes=[b"x"] * (n // 4))


@pytest.mark.parametrize(("hit", "settings", "n", "want"), [
    (32, {}, 45, True),                       # the store holds a prefix: a load can start
    (0, {}, 45, False),                       # nothing stored: it can only compute
    (32, {"load_async": False}, 45, False),   # loads are synchronous: never asynchronous
    (32, {"enable_lookup": False}, 45, False),  # lookups off
    (32, {}, 3, False),                       # shorter than one hash block: no lookup
])
def test_may_load_async_is_true_exactly_when_a_lookup_can_answer_async(
        hit: int, settings: dict[str, object], n: int, want: bool) -> None:
    s = _side(**settings)
    s.lookup_client = _Lookups(hit)
    req = _req(n=n)
    assert s.may_load_async(req) is want
    matched = s.get_num_new_matched_tokens(req, 0)
    assert (matched[1] and matched[0] > 0) is want  # the later ask agrees


def test_may_load_async_after_a_failed_load_or_store_error_is_false() -> None:
    s = _side()
    s.lookup_client = _Lookups(32)
    assert s.may_load_async(_req())
    s.update_connector_output(None, failed_recving={"r"})
    assert not s.may_load_async(_req())  # recomputed, never offered the store again
    s.lookup_client = _Lookups(32, fail=True)
    assert not s.may_load_async(_req("q"))
    assert s.metrics.lookup_errors == 1


def test_lookahead_hashing_is_refused_in_one_line_naming_the_setting() -> None:
    from tailproof.impl.connector import lookahead_problem

    assert lookahead_problem(SimpleNamespace()) is None  # vLLM 0.33: no such field
    assert lookahead_problem(SimpleNamespace(num_hash_lookahead_tokens=0)) is None
    msg = lookahead_problem(SimpleNamespace(num_hash_lookahead_tokens=3))
    assert msg is not None and "\n" not in msg
    assert "disable_lookahead_block_hashes" in msg


def test_the_connector_declares_its_hooks() -> None:
    """Lookahead off (keys are plain block hashes); on 0.34, in-process KV access."""
    from tailproof.impl.connector import TailproofConnector

    assert TailproofConnector.supports_lookahead_block_hashes(None) is False
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # vLLM 0.33 has no KVCacheAccess and never asks
        return
    access = TailproofConnector.kv_cache_access(None)
    assert access == KVCacheAccess.IN_PROCESS and not access.needs_single_chunk()


def test_release_switches_read_the_installed_vllm() -> None:
    """``resumed_as_cached``: 0.33 has ``CachedRequestData``'s field ``RESUMED_ROWS`` (the name
    the scheduler side reads), 0.34 not."""
    import vllm

    from tailproof.impl.vllm_release import junction_hook_supported, resumed_as_cached

    assert resumed_as_cached() is str(vllm.__version__).startswith("0.33.")
    assert junction_hook_supported("0.33.0") and junction_hook_supported("0.34.1")
    assert not junction_hook_supported("0.35.0") and not junction_hook_supported("0.3")
