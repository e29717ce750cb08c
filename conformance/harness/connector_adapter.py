"""The argument checks and observation helpers of the connector ops of trace format v1 that
every connector adapter shares (through ``adapters.base.ConnectorAdapter``), so that they can
differ only in what they do. The ops' specs are in ``format/ops.py``, the ``config.connector``
section in ``format/connector_config.py``.

See ``docs/connector-ops.md`` for the meaning of every op and observation.
"""

from __future__ import annotations

from typing import Any

# --- op argument checks (ANY fields) ----------------------------------------------------


def _rid_list(v: Any, name: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"{name} must be a list of request ids")
    return list(v)


def scheduled_arg(v: Any, default: dict[str, int]) -> dict[str, int]:
    """``conn_step.scheduled``: {rid: tokens}, or null for the driver's allocations this step."""
    if v is None:
        return dict(default)
    if not isinstance(v, dict) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in v.items()):
        raise ValueError("scheduled must be an object {rid: tokens}")
    return dict(v)


def offer_arg(v: Any) -> list[tuple[str, int, int, int]]:
    """``conn_step.offer``: extra hand-offs ``[[rid, group, boundary, block], ...]`` that the
    core never produces (a null block, a non-Mamba group): what a connector must refuse."""
    if not isinstance(v, list) or not all(
            isinstance(e, list) and len(e) == 4 and isinstance(e[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e[1:])
            for e in v):
        raise ValueError("offer must be a list of [rid, group, boundary, block]")
    return [(e[0], e[1], e[2], e[3]) for e in v]


def rid_set(v: Any, name: str) -> set[str]:
    return set(_rid_list(v, name))


def workers_arg(v: Any, num_workers: int) -> list[int]:
    if v is None:
        return list(range(num_workers))
    if not isinstance(v, list) or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < num_workers for w in v):
        raise ValueError(f"workers must be a list of ints in 0..{num_workers - 1}")
    return list(v)


# --- observation helpers ------------------------------------------------------------------


def put_obs(puts: list[tuple[int, int, int]]) -> list[dict[str, int]]:
    """Boundary puts as {group, boundary, block} (``block`` is renamed in loose mode)."""
    return [{"group": g, "boundary": b, "block": blk} for g, blk, b in puts]


def job_obs(job_id: int | None, rid: str, start: int, end: int, publish: bool,
            puts: list[tuple[int, int, int]], pins: list[int]) -> dict[str, Any]:
    return {"job": job_id, "rid": rid, "start": start, "end": end, "publish": publish,
            "puts": put_obs(puts), "pins": list(pins)}


def held_obs(pinned: dict[int, tuple[list[int], int]]) -> list[list[int]]:
    """Live store jobs as [job, ranks yet to report] (their block ids are in ``pins``)."""
    return [[j, r] for j, (_, r) in sorted(pinned.items())]


def batch_obs(tags: list[tuple[int, int, int, str]], entry: Any) -> dict[str, Any]:
    """One put batch of a job: its keys as [group, boundary] and the scripted result."""
    return {"put": [[g, b] for _, g, b, _ in tags], "result": entry}


def offload_obs(offloads: dict[str, list[tuple[int, int, int]]]) -> list[dict[str, Any]]:
    return [{"rid": rid, "group": g, "boundary": b, "block": blk}
            for rid, entries in offloads.items() for g, blk, b in entries]
