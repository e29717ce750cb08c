"""The step protocol the loader checks on top of the per-op fields (docs/trace-format.md,
"Step protocol"): what ``validate``, ``replay``, ``expect`` and ``shrink`` all refuse.

vLLM's scheduler turns one ``allocate_slots`` into exactly one ``_update_after_schedule``
(``commit``); an output token (``append_output``, ``update_from_output``) arrives after the
step's forward. A trace that breaks this still runs, but its KV is not what any engine would
compute, so an adapter's byte check or an error class diverges (exit 1) although the trace is
what is wrong. The rules, per request:

* ``commit`` needs an ``allocate`` of the request since its last commit, not one the trace
  says failed (``expect.ok: false``) nor an asynchronous load's (``delay_cache``, landed by
  ``remote_kv_ready``): a duplicated or stray commit is refused;
* an ``allocate`` the trace says succeeded (``expect.ok: true``) must be committed before the
  request's next ``allocate``;
* a request a ``conn_step`` scheduled (its ``scheduled`` map, or with ``scheduled: null`` every
  allocation of the step the trace says succeeded) is committed before the next ``new_step``;
* ``max_model_len`` and ``max_num_scheduled_tokens`` are >= 1 (``trace_checks.check_config``).

Where an output token lands is not checked: authored traces append it right after the commit
or after the next ``new_step``, captures just before the commit they record late, and vLLM
gives all three the same KV.

An allocation without an expectation may fail, so the rules that need its outcome skip it.
Every failure is one ``CheckError`` naming the op index.
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format.observations import OBSERVES


class ProtocolError(ValueError):
    """One break of the step protocol: where (``ops[7].op``) and what."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}")


def _ok(op: dict[str, Any]) -> bool | None:
    """What the trace says the allocation did (None: it does not say)."""
    exp = op.get("expect")
    v = exp.get("ok") if isinstance(exp, dict) else None
    return v if isinstance(v, bool) else None


class StepProtocol:
    """Fed every normalised op in order (``see``); raises ProtocolError at the first break."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[int, bool]] = {}  # rid -> (allocate index, known ok)
        self.step_ok: set[str] = set()  # allocations of this step the trace says succeeded
        self.awaiting: dict[str, int] = {}  # rid -> the conn_step that scheduled it
        self.committed: set[str] = set()  # committed since the last new_step

    def see(self, i: int, op: dict[str, Any]) -> None:
        name = op["op"]
        rid = op.get("rid")
        where = f"ops[{i}]"
        if "expect" in op:
            _check_expect_keys(where, name, op["expect"])
        if name == "new_step":
            if self.awaiting:
                r, j = next(iter(self.awaiting.items()))
                raise ProtocolError(f"{where}.op", f"new_step before the commit of {r!r}, which "
                                    f"the conn_step at ops[{j}] scheduled (a step's scheduled "
                                    "requests are committed before the next step)")
            self.step_ok.clear()
            self.committed.clear()
        elif name == "allocate":
            prev = self.pending.get(rid)
            if prev is not None and prev[1]:
                raise ProtocolError(f"{where}.op", f"allocate of {rid!r} while its allocate at "
                                    f"ops[{prev[0]}] (ok) was never committed")
            ok = _ok(op)
            if ok is False or op.get("delay_cache"):
                # failed, or an asynchronous load's allocation: the request waits for remote
                # KV (WAITING_FOR_REMOTE_KVS), is not scheduled and so not committed
                self.pending.pop(rid, None)
            else:
                self.pending[rid] = (i, ok is True)
                if ok:
                    self.step_ok.add(rid)
        elif name == "commit":
            if self.pending.pop(rid, None) is None:
                raise ProtocolError(f"{where}.op", f"commit of {rid!r} with no allocate since "
                                    "its last commit (a duplicated or stray commit; an "
                                    "allocate that failed is not committed)")
            self.awaiting.pop(rid, None)
            self.committed.add(rid)
        elif name == "conn_step":
            sched = op.get("scheduled")
            rids = set(self.step_ok) if sched is None else {r for r, n in sched.items() if n}
            self.awaiting = {r: i for r in sorted(rids) if r not in self.committed
                             and r in self.pending}
        elif name in ("free", "preempt"):
            self.pending.pop(rid, None)
            self.awaiting.pop(rid, None)
            self.step_ok.discard(rid)


def _check_expect_keys(where: str, name: str, expect: dict[str, Any]) -> None:
    """An ``expect`` key no adapter observes on this op is refused by the loader (a typo or a
    field of another op), so ``validate`` and ``replay`` agree."""
    known = OBSERVES.get(name)
    if known is None:
        return
    for key in expect:
        if key not in known:
            raise ProtocolError(f"{where}.expect.{key}", f"no adapter observes {key!r} on op "
                                f"{name!r} (observed: {', '.join(sorted(known))})")


def observed_problem(ops: list[dict[str, Any]],
                     observations: list[dict[str, Any] | None]) -> str | None:
    """The first protocol break of ``ops`` once each allocation's outcome is known from an
    adapter's ``observations`` (what the loader cannot know: an allocation without an
    expectation may fail); None when there is none. ``replay`` and ``shrink`` use it."""
    protocol = StepProtocol()
    for i, (op, obs) in enumerate(zip(ops, observations, strict=True)):
        if op["op"] == "allocate" and obs is not None and isinstance(obs.get("ok"), bool):
            op = {k: v for k, v in op.items() if k != "expect"}
            op["expect"] = {"ok": obs["ok"]}
        elif "expect" in op:
            op = {k: v for k, v in op.items() if k != "expect"}
        try:
            protocol.see(i, op)
        except ProtocolError as e:
            return str(e)
    return None
