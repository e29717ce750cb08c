"""Whole-trace checks the loader runs after the per-field ones: size limits, id and key
ranges, the free-form connector fields, expectation shapes, and the step order the docs
require. Each failure is one ``TraceError`` line naming ``ops[i].field``.
"""

from __future__ import annotations

from typing import Any

from tailproof.conformance.format import limits as L
from tailproof.conformance.format import ops as opspec
from tailproof.conformance.format.compare import Renamer
from tailproof.conformance.format.step_protocol import ProtocolError, StepProtocol


class CheckError(ValueError):
    """One problem: where (``ops[3].keys``) and what."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}")


def check_config(config: Any) -> None:
    """Sizes of the pool, the groups and the scheduler's budgets."""
    if len(config.groups) > L.MAX_GROUPS:
        raise CheckError("config.groups", f"more than {L.MAX_GROUPS} groups")
    for i, g in enumerate(config.groups):
        if g.block_size > L.MAX_BLOCK_SIZE:
            raise CheckError(f"config.groups[{i}].block_size",
                             f"{g.block_size} is over the limit of {L.MAX_BLOCK_SIZE}")
    if config.num_blocks > L.MAX_NUM_BLOCKS:
        raise CheckError("config.num_blocks",
                         f"{config.num_blocks} is over the limit of {L.MAX_NUM_BLOCKS}")
    slots = config.num_blocks * max(config.block_sizes)
    if slots > L.MAX_POOL_TOKENS:
        raise CheckError("config.num_blocks", f"num_blocks x largest block size = {slots} token "
                         f"slots, over the limit of {L.MAX_POOL_TOKENS}")
    if config.scheduler_block_size > L.MAX_TOKEN_COUNT:
        raise CheckError("config.groups", f"the lcm of the block sizes "
                         f"({config.scheduler_block_size}) is over {L.MAX_TOKEN_COUNT}")
    for key in ("max_model_len", "max_num_scheduled_tokens", "long_prefill_token_threshold"):
        v = getattr(config, key)
        if v > L.MAX_TOKEN_COUNT:
            raise CheckError(f"config.{key}", f"{v} is over the limit of {L.MAX_TOKEN_COUNT}")
    for key in ("max_model_len", "max_num_scheduled_tokens"):
        # vLLM's ModelConfig / SchedulerConfig: no request fits a 0-token model, no step
        # schedules from a 0-token budget (0 turns only long_prefill_token_threshold off)
        if getattr(config, key) < 1:
            raise CheckError(f"config.{key}", f"must be >= 1, got {getattr(config, key)}")


def _count(where: str, v: Any, limit: int = L.MAX_TOKEN_COUNT) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and v > limit:
        raise CheckError(where, f"{v} is over the limit of {limit}")


class _Order:
    """The step order of docs/connector-ops.md: inside a step, ``conn_step`` comes before the
    commits of the requests it scheduled, and no worker runs a job before those commits (the
    job would save KV the step has not computed yet: bad input, not a data-integrity bug).

    A request whose allocation failed is allocated but never scheduled or committed, and the
    loader cannot know which allocations fail; so the error is a commit of a scheduled
    request that follows a worker_run of the same step (reported at that worker_run)."""

    def __init__(self) -> None:
        self.allocated: set[str] = set()  # allocate ops since the last new_step
        self.awaiting: set[str] = set()  # scheduled by this step's conn_step, not committed
        self.worker_run: int | None = None  # a worker_run after this step's conn_step

    def see(self, i: int, op: dict[str, Any]) -> None:
        name = op["op"]
        if name == "new_step":
            self.allocated.clear()
            self.awaiting.clear()
            self.worker_run = None
        elif name == "allocate":
            self.allocated.add(op["rid"])
        elif name == "conn_step":
            sched = op["scheduled"]
            rids = set(self.allocated) if sched is None else {r for r, n in sched.items() if n}
            self.awaiting = rids
            self.worker_run = None
        elif name == "commit":
            if op["rid"] in self.awaiting and self.worker_run is not None:
                raise CheckError(f"ops[{self.worker_run}].op", "worker_run before the commit of "
                                 f"{op['rid']!r}, which this step's conn_step scheduled (order: "
                                 "conn_step, commit, then worker_run)")
            self.awaiting.discard(op["rid"])
        elif name in ("free", "preempt", "conn_finish"):
            self.awaiting.discard(op["rid"])
            self.allocated.discard(op["rid"])
        elif name == "worker_run" and self.awaiting and self.worker_run is None:
            self.worker_run = i


def _rids(where: str, v: Any, known: set[str]) -> None:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise CheckError(where, "must be a list of request ids")
    for x in v:
        if x not in known:
            raise CheckError(where, f"unknown request id {x!r}")


def _connector_fields(where: str, op: dict[str, Any], known: set[str],
                      num_workers: int) -> None:
    name = op["op"]
    if name == "conn_step":
        s = op["scheduled"]
        if s is not None:
            if not isinstance(s, dict) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in s.values()):
                raise CheckError(f"{where}.scheduled", "must be null or an object {rid: tokens}")
            for r, n in s.items():
                if r not in known:
                    raise CheckError(f"{where}.scheduled", f"unknown request id {r!r}")
                _count(f"{where}.scheduled", n)
        _rids(f"{where}.finished", op["finished"], known)
        _rids(f"{where}.preempted", op["preempted"], known)
    if name == "worker_run":
        if op["worker"] >= num_workers:
            raise CheckError(f"{where}.worker",
                             f"worker {op['worker']} out of range (num_workers {num_workers})")
        from tailproof.reference.connector.store import check_script
        try:
            check_script(op["store"])
        except ValueError as e:
            raise CheckError(f"{where}.store", str(e)) from None
        for entry in op["store"]:
            for x in entry if isinstance(entry, list) else []:
                if isinstance(x, int) and not -(1 << 31) <= x < 1 << 31:
                    raise CheckError(f"{where}.store", f"result code {x} is not an int32")
    if name in ("worker_report", "store_seed", "store_remove"):
        w = op["workers"]
        if w is not None and (not isinstance(w, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < num_workers
                for x in w)):
            raise CheckError(f"{where}.workers", f"must be null or a list of ints in "
                             f"0..{num_workers - 1}")


def _store_keys(where: str, op: dict[str, Any], config: Any, tokens: int) -> None:
    """``store_seed``/``store_remove`` keys name a stored prefix of the request: a group of the
    trace and a boundary that is a positive multiple of h within the request's tokens."""
    h = config.hash_block_size
    for k, (g, b) in enumerate(op["keys"]):
        if g >= len(config.groups):
            raise CheckError(f"{where}.keys[{k}]", f"group {g} out of range "
                             f"(the trace has {len(config.groups)} groups)")
        if b <= 0 or b % h or b > tokens:
            raise CheckError(f"{where}.keys[{k}]", f"boundary {b} must be a multiple of h={h} "
                             f"in 1..{tokens} (the tokens of request {op['rid']!r})")


def check_ops(ops: list[dict[str, Any]], config: Any, protocol: bool = False) -> None:
    """Bounds, ranges and order of the normalised ops of a trace (after per-field checks);
    with ``protocol``, also the step protocol (``step_protocol``: what the CLI's loader
    refuses; the in-process fuzzers and generators drive off-protocol sequences on purpose,
    where the reference and vLLM must still agree)."""
    if len(ops) > L.MAX_OPS:
        raise CheckError("ops", f"{len(ops)} ops, over the limit of {L.MAX_OPS}")
    specs = opspec.all_op_specs()
    conn = config.connector or {}
    num_workers = conn.get("num_workers", 1)
    order = _Order()
    steps = StepProtocol() if protocol else None
    tokens: dict[str, int] = {}
    total = 0
    for i, op in enumerate(ops):
        where = f"ops[{i}]"
        name = op["op"]
        for fname, f in specs[name].items():
            v = op.get(fname)
            w = f"{where}.{fname}"
            if f.kind in (opspec.RID, opspec.NEW_RID) and len(v) > L.MAX_RID_LEN:
                raise CheckError(w, f"request id longer than {L.MAX_RID_LEN} characters")
            elif f.kind in (opspec.NAT, opspec.POS, opspec.NAT_OR_NULL, opspec.NAT_OR_PLAN):
                _count(w, v)
            elif f.kind == opspec.IDS and v is not None:
                for x in v:
                    if x >= config.num_blocks:
                        raise CheckError(w, f"block id {x} is not below num_blocks="
                                         f"{config.num_blocks}")
            elif f.kind == opspec.KEYS and v is not None:
                for k, (g, b) in enumerate(v):
                    if g >= len(config.groups):
                        raise CheckError(f"{w}[{k}]", f"group {g} out of range "
                                         f"(the trace has {len(config.groups)} groups)")
                    _count(f"{w}[{k}]", b)
            elif f.kind == opspec.TOKENS:
                total += len(v)
                if total > L.MAX_TOKENS_PER_TRACE:
                    raise CheckError(w, f"the trace's token lists exceed "
                                     f"{L.MAX_TOKENS_PER_TRACE} tokens in all")
        if name == "add_request":
            tokens[op["rid"]] = len(op["tokens"])
        elif name == "append_output":
            tokens[op["rid"]] += len(op["tokens"])
        _connector_fields(where, op, set(tokens), num_workers)
        if name in ("store_seed", "store_remove"):
            _store_keys(where, op, config, tokens[op["rid"]])
        if "expect" in op:
            _check_expect(f"{where}.expect", op["expect"])
        order.see(i, op)
        if steps is not None:
            try:
                steps.see(i, op)
            except ProtocolError as e:
                raise CheckError(*str(e).split(": ", 1)) from None


def _check_expect(where: str, expect: dict[str, Any]) -> None:
    """An expectation must survive the comparison's own walk (ids renamed, pairs sorted)."""
    try:
        Renamer().canon(expect)
    except (TypeError, IndexError, KeyError, ValueError):
        raise CheckError(where, "malformed: block-id fields (refcounts, keys, ...) "
                         "do not have the observation's shape") from None
