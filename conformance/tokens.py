"""Compact token notation: traces spell long or shared prompts without listing every id.

An item is an int, ``{"fill": v, "n": k}`` (k copies of v), ``{"range": [a, b]}`` (a..b-1), or
``{"prompt_of": "A", "n": k}`` (the first k prompt tokens of request A, for shared prefixes).
"""

from __future__ import annotations

from typing import Any


class TokenError(ValueError):
    """A token item that cannot be expanded; the message names the offending part."""


def expand(items: Any, prompts: dict[str, list[int]]) -> list[int]:
    """Expand a token list given the prompts of the requests added so far."""
    if not isinstance(items, list):
        raise TokenError("must be a list")
    out: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, bool):
            raise TokenError(f"item {i}: must be an int or an object")
        if isinstance(item, int):
            if item < 0:
                raise TokenError(f"item {i}: negative token id {item}")
            out.append(item)
        elif isinstance(item, dict):
            out.extend(_expand_item(i, item, prompts))
        else:
            raise TokenError(f"item {i}: must be an int or an object")
    return out


def _nat(i: int, item: dict[str, Any], key: str) -> int:
    v = item.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TokenError(f"item {i}: {key} must be an int >= 0")
    return v


def _expand_item(i: int, item: dict[str, Any], prompts: dict[str, list[int]]) -> list[int]:
    if set(item) == {"fill", "n"}:
        return [_nat(i, item, "fill")] * _nat(i, item, "n")
    if set(item) == {"range"}:
        r = item["range"]
        ok = isinstance(r, list) and len(r) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
        if not ok or r[1] < r[0]:
            raise TokenError(f"item {i}: range must be [a, b] with 0 <= a <= b")
        return list(range(r[0], r[1]))
    if set(item) == {"prompt_of", "n"}:
        src = item["prompt_of"]
        if src not in prompts:
            raise TokenError(f"item {i}: prompt_of: unknown request {src!r}")
        n = _nat(i, item, "n")
        if n > len(prompts[src]):
            raise TokenError(f"item {i}: n: request {src!r} has only {len(prompts[src])} tokens")
        return prompts[src][:n]
    raise TokenError(f"item {i}: unknown token item keys {sorted(item)}")
