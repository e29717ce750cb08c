"""Turn trace ops into calls on a ``CoreBackend`` (and an optional connector) and build the
observation of each op.

Every adapter shares this driver, so two implementations can only differ in what they do,
never in how their results are written down. Each observation is a plain JSON object and
always carries ``free`` (the free-block count after the op); an op that raises observes
``{"error": "<ExceptionClass>"}`` so that an assertion in one implementation and not in
another is a divergence, not a crash.
"""

from __future__ import annotations

from typing import Any, Protocol

from tailproof.conformance.format.ops import CORE_OPS
from tailproof.conformance.format.trace import TraceConfig
from tailproof.conformance.harness.backend import CoreBackend, RequestView

Observation = dict[str, Any]


class Connector(Protocol):
    """The connector half of an adapter: runs the connector ops of a trace."""

    ops: frozenset[str]

    def apply(self, op: dict[str, Any], ctx: StepContext) -> Observation:
        """Run one connector op and return its observation (without ``free``)."""


class StepContext:
    """What a connector op may read and do of the scheduler around the connector: the core's
    requests and tables, this step's allocations and hand-offs, the pending local hit. It is
    all a connector adapter sees of the driver (the bookkeeping stays the driver's)."""

    def __init__(self, driver: CoreDriver) -> None:
        self._driver = driver

    def request(self, rid: str) -> Any:
        """The core backend's own request object (``vllm.v1.request.Request`` or the
        reference's ``Request``): what the connector's scheduler role is handed."""
        return self._driver.core.requests[rid]

    def view(self, rid: str) -> RequestView:
        """The request's counters."""
        return self._driver.core.get(rid)

    def table(self, rid: str) -> list[list[int]]:
        """The request's block table per group (``get_block_ids``)."""
        return self._driver.core.table(rid)

    def scheduled(self) -> dict[str, int]:
        """Tokens allocated per request since the last ``new_step``."""
        return dict(self._driver.step_scheduled)

    def allocated(self, rid: str) -> list[list[int]] | None:
        """The request's new blocks of this step (None: no allocation this step)."""
        return self._driver.step_allocations.get(rid)

    def take_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's boundary hand-offs per request (``CoreDriver.take_step_offloads``)."""
        return self._driver.take_step_offloads()

    def pending_hit(self, rid: str) -> int:
        return self._driver.pending_hit(rid)

    def truncate_pending_hit(self, rid: str, num_tokens: int) -> None:
        self._driver.truncate_pending_hit(rid, num_tokens)

    def finalize_tail(self, rid: str) -> list[tuple[int, int, int]]:
        """``finalize_partial_tail_offloads``: [(group, block, boundary)]."""
        return self._driver.core.finalize_tail(rid)

    def remove_skipped(self, rid: str) -> None:
        self._driver.core.remove_skipped(rid)

    def computed_block_ids(self, rid: str) -> list[list[int]]:
        """``get_block_ids_for_computed_tokens``: what ``_connector_finished`` hands over."""
        return self._driver.core.block_ids_for_computed_tokens(rid)


class CoreDriver:
    """Runs one trace's ops on one backend, keeping the per-trace bookkeeping that the
    scheduler keeps around the manager (pending hits, planned chunks, retained handles)."""

    def __init__(self, config: TraceConfig, core: CoreBackend,
                 connector: Connector | None = None) -> None:
        self.config = config
        self.core = core
        self.connector = connector
        self.hits: dict[str, int] = {}  # pending lookup hit per request
        self.planned: dict[str, int] = {}  # last plan_chunk result per request
        self.last_alloc: dict[str, int] = {}  # num_new_tokens of the last allocate
        self.retained: dict[int, list[int]] = {}  # drained, unreleased CoW retentions
        self.next_handle = 0
        self.last_offloads: list[tuple[str, int, int, int]] = []  # (rid, group, block, bnd)
        self.step_allocations: dict[str, list[list[int]]] = {}  # new blocks this step
        self.step_scheduled: dict[str, int] = {}  # tokens allocated per request this step
        # Hand-offs drained by drain_offloads ops and not yet consumed by a connector step
        # (the connector's conn_step takes them; connector issue).
        self.undelivered_offloads: list[tuple[str, int, int, int]] = []
        # Ops this driver did not observe: connector ops it cannot run and, once one was
        # skipped (``detached``), every later op (still run, not observed; connector issue).
        self.skipped: list[str] = []
        self.detached = False
        self.context = StepContext(self)  # what the connector sees of this driver

    # -- what connector ops read and change of the scheduler's bookkeeping ------------------
    def pending_hit(self, rid: str) -> int:
        """The local hit of the request's last ``lookup`` not yet consumed by an allocation."""
        return self.hits.get(rid, 0)

    def truncate_pending_hit(self, rid: str, num_tokens: int) -> None:
        """Cut the pending local hit back to ``num_tokens``, as ``Scheduler.schedule`` does
        when a remote hit replaces a local sub-block tail (``reference.connector.lookup.
        arbitrate``; ``truncate_computed_blocks``, KM:809-840)."""
        self.core.truncate_pending(rid, num_tokens)
        self.hits[rid] = num_tokens

    def take_step_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's boundary hand-offs, per request: those drained by ``drain_offloads`` ops
        since the last call plus whatever is still pending in the core (vLLM drains every step,
        SC:1681)."""
        flat, self.undelivered_offloads = self.undelivered_offloads, []
        flat += self.core.drain_offloads()
        out: dict[str, list[tuple[int, int, int]]] = {}
        for rid, g, blk, b in flat:
            out.setdefault(rid, []).append((g, blk, b))
        return out

    def close(self) -> None:
        """The trace is over: the connector releases what it allocated (the impl adapter's
        threads, tensors and store); adapters without a ``close`` hold nothing to release."""
        close = getattr(self.connector, "close", None)
        if close is not None:
            close()

    def supports(self, name: str) -> bool:
        return name in CORE_OPS or (self.connector is not None and name in self.connector.ops)

    def apply(self, op: dict[str, Any]) -> Observation | None:
        """Observation of ``op``, or None when this adapter does not run that op."""
        name = op["op"]
        if not self.supports(name):
            # A skipped connector op (pins, store jobs) changes block state that later core
            # observations (free counts, refcounts) reflect; from here on this adapter's
            # observations are not comparable, so the ops still run but observe nothing.
            self.detached = True
            self.skipped.append(name)
            return None
        if self.detached:
            self._apply(op, name)
            self.skipped.append(name)
            return None
        return self._apply(op, name)

    def _apply(self, op: dict[str, Any], name: str) -> Observation:
        try:
            if name in CORE_OPS:
                obs = getattr(self, f"_op_{name}")(op)
            else:
                assert self.connector is not None
                obs = self.connector.apply(op, self.context)
        except Exception as e:  # noqa: BLE001 - an implementation's failure is data
            obs = {"error": type(e).__name__}
        obs["free"] = self.core.num_free()
        return obs

    # -- requests and steps -------------------------------------------------------------
    def _op_add_request(self, op: dict[str, Any]) -> Observation:
        self.hits.pop(op["rid"], None)
        return {"num_hashes": self.core.add_request(op["rid"], op["tokens"], op["max_tokens"])}

    def _op_append_output(self, op: dict[str, Any]) -> Observation:
        return {"num_hashes": self.core.append_output(op["rid"], op["tokens"])}

    def _op_new_step(self, op: dict[str, Any]) -> Observation:
        # A connector that acts after a step's forward (the extension's snapshot copies,
        # ``wait_for_save``) learns here that the previous step is over.
        if (hook := getattr(self.connector, "step_starts", None)) is not None:
            hook()
        self.core.new_step()
        self.step_allocations.clear()
        self.step_scheduled.clear()
        return {}

    def _op_commit(self, op: dict[str, Any]) -> Observation:
        rid = op["rid"]
        n = op["n"] if op["n"] is not None else self.last_alloc.get(rid, 0)
        computed = self.core.get(rid).num_computed_tokens + n
        self.core.set_counters(rid, num_computed_tokens=computed)
        return {"computed": computed}

    def _op_rollback(self, op: dict[str, Any]) -> Observation:
        """Rejected drafts: ``Scheduler.update_from_output`` takes the ``n`` rejected draft
        tokens back off ``num_computed_tokens`` (which ``commit`` advanced by every scheduled
        draft), when it is positive."""
        rid = op["rid"]
        computed = self.core.get(rid).num_computed_tokens
        if computed > 0:
            computed = max(0, computed - op["n"])
            self.core.set_counters(rid, num_computed_tokens=computed)
        return {"computed": computed}

    def _op_remote_kv_ready(self, op: dict[str, Any]) -> Observation:
        """An asynchronous load (``allocate delay_cache``) landed:
        ``Scheduler._update_waiting_for_remote_kv`` caches the request's blocks up to its
        computed tokens and, when the load covered the whole request, leaves the last token
        to compute (no prefix-replay window: no sliding-window group)."""
        rid = op["rid"]
        view = self.core.get(rid)
        computed = view.num_computed_tokens
        self.core.cache_blocks(rid, computed)
        if computed == view.num_tokens:
            computed = view.num_tokens - 1
            self.core.set_counters(rid, num_computed_tokens=computed)
        return {"computed": computed}

    def _op_set_in_flight(self, op: dict[str, Any]) -> Observation:
        self.core.set_counters(op["rid"], num_in_flight_tokens=op["n"])
        return {}

    # -- lookup, planning, allocation ---------------------------------------------------
    def _op_lookup(self, op: dict[str, Any]) -> Observation:
        hit, blocks = self.core.lookup(op["rid"], op["max_len"])
        self.hits[op["rid"]] = hit
        junction = self.core.get(op["rid"]).shared_prefix_boundary
        return {"hit": hit, "blocks": blocks, "junction": junction}

    def _op_plan_chunk(self, op: dict[str, Any]) -> Observation:
        """Mirrors how ``Scheduler.schedule`` sizes a chunk before the Mamba split: remaining
        tokens plus the request's ``drafts`` (``num_tokens_with_spec``: speculative tokens a
        running request scheduled for verification), capped by the long-prefill threshold
        and the token budget."""
        rid = op["rid"]
        view = self.core.get(rid)
        hit = self.hits.get(rid, 0) if op["use_hit"] else 0
        start = view.num_computed_tokens + hit + op["external"]
        num_new = max(0, view.num_tokens - start) + op["drafts"]
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        budget = op["budget"] if op["budget"] is not None else self.config.max_num_scheduled_tokens
        num_new = min(num_new, budget)
        chunk = self.core.plan_chunk(rid, num_new, hit, op["external"]) if num_new else 0
        self.planned[rid] = chunk
        return {"chunk": chunk}

    def _op_allocate(self, op: dict[str, Any]) -> Observation:
        rid = op["rid"]
        n = self.planned.get(rid, 0) if op["n"] == "plan" else op["n"]
        new = self.core.allocate(rid, n, use_hit=op["use_hit"], external=op["external"],
                                 delay_cache=op["delay_cache"], lookahead=op["lookahead"],
                                 reserved=op["reserved"])
        self.hits.pop(rid, None)
        self.last_alloc[rid] = n if new is not None else 0  # nothing to commit on failure
        if new is not None:
            self.step_allocations[rid] = new
            self.step_scheduled[rid] = self.step_scheduled.get(rid, 0) + n
        return {"ok": new is not None, "new": new}

    def _op_truncate(self, op: dict[str, Any]) -> Observation:
        return {"blocks": self.core.truncate(op["rid"], op["n"])}

    # -- copies, hand-offs, finish ------------------------------------------------------
    def _op_drain_copies(self, op: dict[str, Any]) -> Observation:
        copies, retained = self.core.drain_copies()
        handle = None
        if retained:
            handle = self.next_handle
            self.next_handle += 1
            self.retained[handle] = retained
        return {"copies": [list(c) for c in copies], "retained": retained, "handle": handle}

    def _op_release_retained(self, op: dict[str, Any]) -> Observation:
        """Free a drained retention (``Scheduler._free_cow_retained_blocks``); with no handle,
        the oldest one, and nothing when none is left."""
        handle = op["handle"] if op["handle"] is not None else min(self.retained, default=None)
        if handle is None and op["handle"] is None:
            return {"released": []}
        if handle not in self.retained:
            raise KeyError(f"no unreleased retention handle {handle}")
        ids = self.retained.pop(handle)
        self.core.release(ids)
        return {"released": ids}

    def _op_drain_offloads(self, op: dict[str, Any]) -> Observation:
        self.last_offloads = self.core.drain_offloads()
        self.undelivered_offloads.extend(self.last_offloads)
        sizes = self.config.block_sizes
        return {"offloads": [
            {"rid": rid, "group": g, "boundary": b, "block": blk,
             "kind": "tail" if b % sizes[g] else "aligned"}
            for rid, g, blk, b in self.last_offloads
        ]}

    def _op_finalize_tail(self, op: dict[str, Any]) -> Observation:
        tails = self.core.finalize_tail(op["rid"])
        return {"tails": [{"group": g, "boundary": b, "block": blk} for g, blk, b in tails]}

    def _op_free(self, op: dict[str, Any]) -> Observation:
        self.core.free(op["rid"])
        self.hits.pop(op["rid"], None)
        return {}

    def _op_preempt(self, op: dict[str, Any]) -> Observation:
        self.core.preempt(op["rid"])
        self.hits.pop(op["rid"], None)
        return {}

    # -- eviction, reset, inspection ----------------------------------------------------
    def _op_evict(self, op: dict[str, Any]) -> Observation:
        if op["blocks"] is not None:
            ids = set(op["blocks"])
        else:
            wanted = {tuple(k) for k in op["keys"]}
            ids = {blk for g, b, blk in self.core.keys() if (g, b) in wanted}
        self.core.evict(ids)
        return {"evicted": sorted(ids)}

    def _op_reset(self, op: dict[str, Any]) -> Observation:
        return {"ok": self.core.reset()}

    def _op_pool_state(self, op: dict[str, Any]) -> Observation:
        return {
            "refcounts": [[b, r] for b, r in sorted(self.core.refcounts().items())],
            "free_queue": self.core.free_queue(),
            "keys": sorted([list(k) for k in self.core.keys()]),
        }

    def _op_table(self, op: dict[str, Any]) -> Observation:
        return {"blocks": self.core.table(op["rid"])}
