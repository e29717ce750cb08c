"""Compact token notation: traces spell long or shared prompts without listing every id.

An item is an int, ``{"fill": v, "n": k}`` (k copies of v), ``{"range": [a, b]}`` (a..b-1), or
``{"prompt_of": "A", "n": k}`` (the first k prompt tokens of request A, for shared prefixes).
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.limits import MAX_TOKENS_PER_LIST, TOKEN_ID_LIMIT


class TokenError(ValueError):
    """A token item that cannot be expanded; the message names the offending part."""


def expand(items: Any, prompts: dict[str, list[int]]) -> list[int]:
    """Expand a token list given the prompts of the requests added so far (at most
    ``MAX_TOKENS_PER_LIST`` tokens, each below 2^63: the sizes are checked before expanding)."""
    if not isinstance(items, list):
        raise TokenError("must be a list")
    out: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, bool):
            raise TokenError(f"item {i}: must be an int or an object")
        if isinstance(item, int):
            if item < 0:
                raise TokenError(f"item {i}: negative token id {item}")
            _check_id(i, item)
            out.append(item)
        elif isinstance(item, dict):
            out.extend(_expand_item(i, item, prompts, MAX_TOKENS_PER_LIST - len(out)))
        else:
            raise TokenError(f"item {i}: must be an int or an object")
        if len(out) > MAX_TOKENS_PER_LIST:
            raise TokenError(f"more than {MAX_TOKENS_PER_LIST} tokens (the limit)")
    return out


def _check_id(i: int, v: int) -> None:
    if v >= TOKEN_ID_LIMIT:
        raise TokenError(f"item {i}: token id {v} is not below 2^63 (token ids are int64)")


def _room(i: int, n: int, room: int) -> None:
    if n > room:
        raise TokenError(f"item {i}: expands to {n} tokens, over the limit of "
                         f"{MAX_TOKENS_PER_LIST} per list")


def _nat(i: int, item: dict[str, Any], key: str) -> int:
    v = item.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TokenError(f"item {i}: {key} must be an int >= 0")
    return v


def _expand_item(i: int, item: dict[str, Any], prompts: dict[str, list[int]],
                 room: int) -> list[int]:
    if set(item) == {"fill", "n"}:
        v, n = _nat(i, item, "fill"), _nat(i, item, "n")
        _check_id(i, v)
        _room(i, n, room)
        return [v] * n
    if set(item) == {"range"}:
        r = item["range"]
        ok = isinstance(r, list) and len(r) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
        if not ok or r[1] < r[0]:
            raise TokenError(f"item {i}: range must be [a, b] with 0 <= a <= b")
        _check_id(i, max(r[1] - 1, 0))
        _room(i, r[1] - r[0], room)
        return list(range(r[0], r[1]))
    if set(item) == {"prompt_of", "n"}:
        src = item["prompt_of"]
        if not isinstance(src, str) or src not in prompts:
            raise TokenError(f"item {i}: prompt_of: unknown request {src!r}")
        n = _nat(i, item, "n")
        if n > len(prompts[src]):
            raise TokenError(f"item {i}: n: request {src!r} has only {len(prompts[src])} tokens")
        return prompts[src][:n]
    raise TokenError(f"item {i}: unknown token item keys {sorted(item)}")
