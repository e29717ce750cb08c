"""``divergent_local_hits="auto"`` (``resolve_divergent_hits``): on where attention blocks are
smaller than the Mamba block (BENCHMARKS.md section 13, issue 22), off where they are not or
where divergent hits cannot run; true where they cannot run is an error."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from tailproof.impl.config import (
    ConfigError,
    Settings,
    StoreGeometry,
    parse_settings,
    resolve_divergent_hits,
)

PLAIN = SimpleNamespace(speculative_config=None)


def _geo(fa: int, mamba: int = 1024) -> StoreGeometry:
    return StoreGeometry(core_group_ids=(0, 1), block_sizes=(fa, mamba), is_mamba=(False, True),
                         hash_block_size=16, scheduler_block_size=max(fa, mamba), partial_hits=True,
                         use_eagle=False)


def test_auto_parses_to_none_and_other_strings_are_refused() -> None:
    assert parse_settings({"divergent_local_hits": "auto"}, None).divergent_local_hits is None
    with pytest.raises(ConfigError, match='divergent_local_hits must be bool or "auto"'):
        parse_settings({"divergent_local_hits": "yes"}, None)


@pytest.mark.parametrize("fa, on", [(16, True), (1024, False)])
def test_auto_follows_the_attention_block(fa: int, on: bool) -> None:
    s, errors = resolve_divergent_hits(Settings(divergent_local_hits=None), _geo(fa), PLAIN)
    assert errors == [] and s.divergent_local_hits is on


def test_auto_is_off_and_true_refused_where_it_cannot_run() -> None:
    eagle = replace(_geo(16), use_eagle=True)
    s, errors = resolve_divergent_hits(Settings(divergent_local_hits=None), eagle, PLAIN)
    assert errors == [] and s.divergent_local_hits is False
    _, errors = resolve_divergent_hits(Settings(divergent_local_hits=True), eagle, PLAIN)
    assert errors and errors[0].startswith("divergent_local_hits=true is not supported here")
    s, errors = resolve_divergent_hits(Settings(), _geo(16), PLAIN)
    assert errors == [] and s.divergent_local_hits is False  # the default stays off
