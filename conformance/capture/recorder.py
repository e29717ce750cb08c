"""Record what a live vLLM scheduler (0.33 or 0.34) does to its KV cache as a tailproof-trace/1
file.

``Recorder.attach(scheduler, path)`` wraps the scheduler's ``KVCacheManager`` (on the
instance; vLLM's code is not changed) and writes one trace op per manager call the trace
format models, with the engine's own result as the op's ``expect``:

================================  =================================================
vLLM 0.33 call                    trace op (observation recorded as ``expect``)
================================  =================================================
``new_step_starts``               ``new_step``
``get_computed_blocks``           ``lookup`` (``hit``, ``blocks``)
``allocate_slots``                ``allocate`` (``ok``, ``new``)
``truncate_computed_blocks``      ``truncate`` (``blocks``)
``take_boundary_state_offloads``  ``drain_offloads`` (``offloads``)
``take_kv_cache_block_copies``    ``drain_copies`` (``copies``, ``retained``, ``handle``)
``Scheduler._free_cow_retained``  ``release_retained`` (``released``)
``_update_waiting_for_remote_kv``  ``remote_kv_ready`` (``computed``): a load landed
``finalize_partial_tail_offloads``  ``finalize_tail`` (``tails``)
``free``                          ``free`` (finished) / ``preempt`` (still running)
``evict_blocks``                  ``evict``; ``reset_prefix_cache``: ``reset`` (``ok``)
================================  =================================================

Every op also expects ``free`` (free blocks after the call). The request's side is written
lazily, right before the first manager call that depends on it: ``add_request`` when the
manager first sees a request, ``append_output`` for tokens appended since, ``commit`` /
``set_in_flight`` when ``num_computed_tokens`` / ``num_in_flight_tokens`` moved (the
scheduler's ``_update_after_schedule`` and ``update_from_output``). So a recorded trace replays
on any adapter and ``tailproof replay trace.json --adapters reference`` names the first op
where the model disagrees with the engine.

The wrappers run on the scheduler's thread and only queue one raw tuple per call (the
request and its counts, the arguments, the result, the free-block count); a writer thread
derives the ops from them (``op_builder.OpBuilder``: request shadows, pending hits, handles,
prefix sharing, redaction) and encodes and writes them in order
(``writer.BackgroundWriter``).

Manager calls the format does not model (``cache_blocks`` outside a landed load that caches
anything, ``pop_blocks_for_free`` of deferred frees, ``get_computed_blocks_for_connector``...)
are counted under ``provenance.unmodelled``: a trace that has any may not replay faithfully.
(vLLM 0.34's synchronous hybrid engines call ``cache_blocks`` after every step: a no-op, which
the recorder checks call by call and does not count.)
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

from tailproof.conformance.capture import connector_recorder
from tailproof.conformance.capture.connector_config import ConnectorConfigError, connector_config
from tailproof.conformance.capture.op_builder import OpBuilder
from tailproof.conformance.capture.writer import BackgroundWriter, TraceWriter
from tailproof.conformance.format.trace import FORMAT_TAG
from tailproof.conformance.vllm_release import hash_map_entries
from tailproof.reference.releases import DEFAULT as DEFAULT_RELEASE
from tailproof.reference.releases import RELEASES

RECORDER_VERSION = "tailproof-recorder/2"
#: ops queued on the step path before they are handed to the writer thread (at a step end)
HAND_OVER_OPS = 256

# Manager methods counted as unmodelled when called (``install`` lists the recorded ones);
# ``cache_blocks`` only when the call changed something (``Recorder._cache_blocks``).
UNMODELLED = ("cache_blocks", "pop_blocks_for_free", "get_computed_blocks_for_connector",
              "record_blocks_for_zeroing", "remove_skipped_blocks")
#: What ``KVCacheManager.cache_blocks`` can change that a trace observes, for the groups a
#: trace can hold (full attention, Mamba align; vLLM 0.33 and 0.34:
#: ``SingleTypeKVCacheManager.cache_blocks``, ``FullAttentionManager`` / ``MambaManager``
#: ``cache_blocks`` and ``_cache_partial_tail_block``): the pool's keys, every change of which
#: goes through ``BlockHashToBlockMap.insert`` / ``pop`` (``BlockPool._insert_block_hash``
#: returns before ``insert`` for a key the block holds already); and per manager the request's
#: entries below plus the hand-offs queued for ``take_boundary_state_offloads``.
#: (``cached_blocks_this_step`` is left out: ``new_step_starts`` clears it before anything
#: reads it after ``update_from_output``.)
MAP_WRITES = ("insert", "pop")
REQUEST_STATE = ("num_cached_block", "_partial_hit_reqs", "_producer_partial_tail_reqs")


class RecorderUnsupported(ValueError):
    """An engine whose KV cache layout the trace format cannot express."""


def config_from_scheduler(scheduler: Any) -> dict[str, Any]:
    """The trace ``config`` of a live scheduler, read from the engine itself."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kvc = scheduler.kv_cache_config
    mgr = scheduler.kv_cache_manager
    groups: list[dict[str, Any]] = []
    for i, g in enumerate(kvc.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise RecorderUnsupported(
                    f"kv_cache_groups[{i}]: Mamba mode {spec.mamba_cache_mode!r}; the trace "
                    "format models align mode only (vLLM 0.33: --enable-prefix-caching)")
            doc: dict[str, Any] = {"kind": "mamba_align", "block_size": spec.block_size}
            if spec.num_speculative_blocks:
                doc["num_speculative_blocks"] = spec.num_speculative_blocks
        elif isinstance(spec, FullAttentionSpec):
            doc = {"kind": "full_attention", "block_size": spec.block_size}
        else:
            raise RecorderUnsupported(
                f"kv_cache_groups[{i}]: {type(spec).__name__} is not modelled by the trace "
                "format (full attention and Mamba-align groups only)")
        if getattr(g, "is_eagle_group", False):
            doc["eagle"] = True
        groups.append(doc)
    cfg: dict[str, Any] = {
        "groups": groups,
        "hash_block_size": scheduler.hash_block_size,
        "num_blocks": kvc.num_blocks,
        "enable_caching": bool(scheduler.cache_config.enable_prefix_caching),
        "use_eagle": bool(mgr.use_eagle),
        "max_model_len": scheduler.max_model_len,
        "max_num_scheduled_tokens": scheduler.max_num_scheduled_tokens,
        "long_prefill_token_threshold":
            scheduler.scheduler_config.long_prefill_token_threshold,
    }
    retention = getattr(kvc, "prefix_cache_retention_interval", None)
    if retention is not None and any(g["kind"] == "mamba_align" for g in groups):
        # vLLM's engine default (0) keeps Mamba states sparsely (reachable_block_mask); the
        # adapters retain densely (KVCacheConfig's default, None) and refuse such a trace.
        cfg["prefix_cache_retention_interval"] = retention
    split = scheduler.cache_config.block_size
    if split in [g["block_size"] for g in groups]:
        cfg["split_block_size"] = split
    lookahead = getattr(getattr(scheduler, "vllm_config", None), "num_hash_lookahead_tokens", 0)
    if lookahead:
        raise RecorderUnsupported(
            f"num_hash_lookahead_tokens={lookahead}: blocks hashed past their end (EAGLE with "
            "lookahead hashes) are not modelled by the trace format (record with "
            "speculative_config.disable_lookahead_block_hashes)")
    release = engine_release()
    if release != DEFAULT_RELEASE:  # a 0.33 capture reads as 0.33 without the key
        cfg["vllm"] = release
    return cfg


def engine_release() -> str:
    """The release whose semantics the recorded engine has (``config.vllm``,
    docs/releases.md): the running vLLM's ``major.minor``, the default when not a supported
    one (the loader then reads the trace as that release)."""
    import vllm

    parts = str(vllm.__version__).split(".")
    name = ".".join(parts[:2])
    return name if name in RELEASES else DEFAULT_RELEASE


def provenance(scheduler: Any, redacted: bool) -> dict[str, Any]:
    import vllm

    from tailproof import __version__ as tailproof_version

    connector = None
    ktc = scheduler.vllm_config.kv_transfer_config
    if ktc is not None:
        connector = ktc.kv_connector
    doc: dict[str, Any] = {"vllm": vllm.__version__, "recorder": RECORDER_VERSION,
                           "tailproof": tailproof_version, "connector": connector,
                           "redacted": redacted}
    if connector is not None:
        try:
            doc["connector_config"] = connector_config(scheduler.vllm_config,
                                                       getattr(scheduler, "connector", None))
        except ConnectorConfigError as e:
            doc["connector_config"] = {"error": str(e)}
    return doc


def connector_note(scheduler: Any) -> str | None:
    """What the trace leaves out when the engine runs a KV connector: its scheduler-side calls
    and worker outcomes are not recorded, so the core ops' observations include pins and
    loads no op of the trace explains (None without a connector)."""
    ktc = scheduler.vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        return None
    return f"KV connector calls and worker outcomes ({ktc.kv_connector}): not recorded"


class Recorder:
    """Wraps one scheduler's ``KVCacheManager`` and writes the trace as the engine runs.

    The step path (the wrappers ``install`` sets) only reads what a call changes or returns
    and appends one raw tuple to a list: ``(OpBuilder method, pre, args, kwargs, result,
    free)``, where ``pre`` is the request and its four counts before the call. Every
    wrapper is one closure over locals (no handler call, no dict built, no list copied);
    the ``OpBuilder`` derives the ops on the writer thread."""

    def __init__(self, scheduler: Any, writer: TraceWriter, *, redact: bool = False,
                 compact: bool = True, config: dict[str, Any] | None = None) -> None:
        self.scheduler = scheduler
        self.mgr = scheduler.kv_cache_manager
        self.pool = self.mgr.block_pool
        self.writer = BackgroundWriter(writer)
        self.config = config or config_from_scheduler(scheduler)
        self.h = self.config["hash_block_size"]
        self.builder = OpBuilder(writer, self.h, [g["block_size"] for g in self.config["groups"]],
                                 redact=redact, compact=compact)
        # The step path only appends tuples here; the list is handed to the writer thread.
        self._batch: list[tuple[Any, ...]] = []
        self._push = self._batch.append
        self._calls: dict[str, int] = {}  # unmodelled manager calls, counted on the step path
        self._depth = 0
        self._absorb_truncate = False  # a connector lookup's truncate is part of its op
        self._finish_pending: str | None = None  # set by the connector recorder
        self._lock = threading.RLock()  # close() / pool_state() against a running engine
        self._queue = self.pool.free_block_queue  # BlockPool.get_num_free_blocks reads it
        self.closed = False
        note = None if self.config.get("connector") else connector_note(scheduler)
        if note is not None:
            self.builder.unmodelled_call(note)

    @property
    def unmodelled(self) -> dict[str, int]:
        """What the trace leaves out, with counts (complete once the recorder is closed)."""
        out = dict(self.builder.unmodelled)
        if not self.closed:
            for k, v in self._calls.items():
                out[k] = out.get(k, 0) + v
        return out

    # -- installation -------------------------------------------------------------------
    @classmethod
    def attach(cls, scheduler: Any, path: str | Path, *, redact: bool = False,
               compact: bool = True, max_bytes: int | None = None, name: str | None = None,
               description: str = "", workers: list[Any] | None = None,
               store_plan: Any = None) -> Recorder:
        """Start recording ``scheduler`` into ``path`` (a trace file, streamed). ``workers``:
        the engine's worker ranks, in rank order, when they run in this process; the
        connector's calls and their store runs are then recorded as connector ops."""
        config = config_from_scheduler(scheduler)
        if workers is not None:
            conn = connector_config(scheduler.vllm_config, getattr(scheduler, "connector", None))
            if conn is None:
                raise RecorderUnsupported("workers: the engine has no KV connector")
            config["connector"] = {**conn, "num_workers": len(workers)}
        header = {
            "format": FORMAT_TAG,
            "name": name or Path(path).stem,
            "description": description or "captured from a live vLLM engine",
            "provenance": provenance(scheduler, redact),
            "config": config,
        }
        rec = cls(scheduler, TraceWriter(path, header, max_bytes), redact=redact,
                  compact=compact, config=config)
        if workers is not None:
            connector_recorder.install(rec, workers, store_plan)
        rec.install()
        if workers is not None:
            connector_recorder.install_finish_hand_off(rec)
        return rec

    def install(self) -> None:
        mgr, sched, b = self.mgr, self.scheduler, self.builder
        for name, make in (("new_step_starts", self._new_step_starts),
                           ("get_computed_blocks", self._request_call(b.lookup)),
                           ("allocate_slots", self._request_call(b.allocate)),
                           ("free", self._free),
                           ("take_boundary_state_offloads", self._drain(b.offloads)),
                           ("take_kv_cache_block_copies", self._drain(b.copies)),
                           ("truncate_computed_blocks", self._truncate),
                           ("finalize_partial_tail_offloads", self._finalize),
                           ("evict_blocks", self._evict),
                           ("reset_prefix_cache", self._reset)):
            setattr(mgr, name, functools.wraps(getattr(mgr, name))(make(getattr(mgr, name))))
        for name in UNMODELLED:
            if hasattr(mgr, name):
                wrap = self._cache_blocks if name == "cache_blocks" else self._count
                setattr(mgr, name, wrap(getattr(mgr, name), name))
        orig = sched._free_cow_retained_blocks
        sched._free_cow_retained_blocks = functools.wraps(orig)(self._release(orig))
        orig = sched._update_waiting_for_remote_kv
        sched._update_waiting_for_remote_kv = functools.wraps(orig)(self._load_landed(orig))

    # Each wrapper: the scheduler calls the manager from one thread; ``_depth`` keeps calls
    # the manager makes on itself (and on the scheduler) from being recorded twice, and
    # close() leaves it raised for good.

    def _new_step_starts(self, orig: Any) -> Any:
        rec, b, q = self, self.builder, self._queue

        def call() -> Any:
            if rec._depth:
                return orig()
            if len(rec._batch) >= HAND_OVER_OPS:
                rec._hand_over()
            out = orig()
            rec._push((b.new_step, q.num_free_blocks))
            return out
        return call

    def _request_call(self, build: Any) -> Any:
        """``get_computed_blocks`` / ``allocate_slots``: (build, pre, args, kwargs, result,
        free)."""
        rec, q = self, self._queue

        def factory(orig: Any) -> Any:
            def call(req: Any, *a: Any, **k: Any) -> Any:
                if rec._depth:
                    return orig(req, *a, **k)
                pre = (req, len(req._all_token_ids), len(req.block_hashes),
                       req.num_computed_tokens, req.num_in_flight_tokens, q.num_free_blocks)
                rec._depth += 1
                try:
                    out = orig(req, *a, **k)
                finally:
                    rec._depth -= 1
                rec._push((build, pre, (req, *a), k, out, q.num_free_blocks))
                return out
            return call
        return factory

    def _free(self, orig: Any) -> Any:
        rec, b, q = self, self.builder, self._queue
        finished_above = _request_status().PREEMPTED  # RequestStatus.is_finished

        def call(req: Any) -> Any:
            if rec._depth:
                return orig(req)
            pre = (req, len(req._all_token_ids), len(req.block_hashes),
                   req.num_computed_tokens, req.num_in_flight_tokens, q.num_free_blocks)
            finished = req.status > finished_above
            rec._depth += 1
            try:
                out = orig(req)
            finally:
                rec._depth -= 1
            rec._push((b.free, pre, finished, q.num_free_blocks))
            return out
        return call

    def _drain(self, build: Any) -> Any:
        rec, q = self, self._queue

        def factory(orig: Any) -> Any:
            def call() -> Any:
                if rec._depth:
                    return orig()
                rec._depth += 1
                try:
                    out = orig()
                finally:
                    rec._depth -= 1
                rec._push((build, out, q.num_free_blocks))
                return out
            return call
        return factory

    def _release(self, orig: Any) -> Any:
        """``Scheduler._free_cow_retained_blocks``: released now unless deferred."""
        rec, b, q, sched = self, self.builder, self._queue, self.scheduler

        def call(blocks: Any, fence_seq: int) -> Any:
            if rec._depth:
                return orig(blocks, fence_seq)
            immediate = not sched.defer_block_free or fence_seq <= sched.processed_step_seq
            kept = tuple(blocks)
            rec._depth += 1
            try:
                out = orig(blocks, fence_seq)
            finally:
                rec._depth -= 1
            rec._push((b.release_retained, immediate, kept, q.num_free_blocks))
            return out
        return call

    def _load_landed(self, orig: Any) -> Any:
        """``Scheduler._update_waiting_for_remote_kv``: a landed asynchronous load is the
        ``remote_kv_ready`` op (its ``cache_blocks`` is part of it); a failed one (its
        partial cache or free) is not modelled."""
        rec, sched, q = self, self.scheduler, self._queue

        def call(req: Any) -> Any:
            if rec._depth:
                return orig(req)
            if req.request_id in sched.failed_recving_kv_req_ids:
                rec._calls["failed remote KV load"] = rec._calls.get(
                    "failed remote KV load", 0) + 1
                return orig(req)
            pre = (req, len(req._all_token_ids), len(req.block_hashes),
                   req.num_computed_tokens, req.num_in_flight_tokens, q.num_free_blocks)
            rec._depth += 1
            try:
                out = orig(req)
            finally:
                rec._depth -= 1
            rec._push((rec.builder.remote_kv_ready, pre, req.num_computed_tokens,
                       q.num_free_blocks))
            return out
        return call

    def _rare(self, orig: Any, after: Any) -> Any:
        """A wrapper for the rare calls: ``after(args, result)`` queues the op."""
        rec = self

        def call(*a: Any, **k: Any) -> Any:
            if rec._depth:
                return orig(*a, **k)
            rec._depth += 1
            try:
                out = orig(*a, **k)
            finally:
                rec._depth -= 1
            after(a, out)
            return out
        return call

    def _truncate(self, orig: Any) -> Any:
        def after(a: tuple[Any, ...], out: Any) -> None:
            if not self._absorb_truncate:  # else: part of the connector's sched_lookup
                self._push((self.builder.truncate, a[1], out, self._queue.num_free_blocks))
        return self._rare(orig, after)

    def _finalize(self, orig: Any) -> Any:
        rec, q = self, self._queue

        def call(req: Any) -> Any:
            if rec._depth:
                return orig(req)
            pre = (req, len(req._all_token_ids), len(req.block_hashes),
                   req.num_computed_tokens, req.num_in_flight_tokens, q.num_free_blocks)
            rec._depth += 1
            try:
                out = orig(req)
            finally:
                rec._depth -= 1
            if rec.config.get("connector"):
                # Scheduler._connector_finished: the op is conn_finish, written after the
                # remove_skipped_blocks that follows (connector_recorder).
                rec._push((rec.builder.sync, pre))
                rec._finish_pending = req.request_id
            else:
                rec._push((rec.builder.finalize_tail, pre, out, q.num_free_blocks))
            return out
        return call

    def _evict(self, orig: Any) -> Any:
        def after(a: tuple[Any, ...], out: Any) -> None:
            ids = sorted(a[0])
            self.emit({"op": "evict", "blocks": ids}, {"evicted": ids})
        return self._rare(orig, after)

    def _reset(self, orig: Any) -> Any:
        def after(a: tuple[Any, ...], out: Any) -> None:
            self.emit({"op": "reset"}, {"ok": bool(out)})
        return self._rare(orig, after)

    def _count(self, orig: Any, name: str) -> Any:
        calls = self._calls

        @functools.wraps(orig)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._depth:
                calls[name] = calls.get(name, 0) + 1
            return orig(*args, **kwargs)
        return call

    def _cache_blocks(self, orig: Any, name: str) -> Any:
        """``cache_blocks`` outside a landed load: counted as unmodelled only when it changed
        something a trace observes (``MAP_WRITES``, ``REQUEST_STATE``). vLLM 0.34's
        ``update_from_output`` calls it for every running request of a synchronous hybrid
        engine after each step ("Publish finalized states before retirement or completion");
        there it repeats what ``allocate_slots`` cached, a no-op that this check proves call by
        call instead of trusting."""
        calls, keys, managers = self._calls, self.pool.cached_block_hash_to_block, \
            self.mgr.coordinator.single_type_managers

        @functools.wraps(orig)
        def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return orig(request, *args, **kwargs)
            wrote: list[str] = []
            saved = {n: keys.__dict__[n] for n in MAP_WRITES if n in getattr(keys, "__dict__",
                                                                              {})}
            before = _request_state(managers, request.request_id)
            for n in MAP_WRITES:
                setattr(keys, n, _spy(getattr(keys, n), n, wrote))
            try:
                out = orig(request, *args, **kwargs)
            finally:
                for n in MAP_WRITES:
                    if n in saved:
                        setattr(keys, n, saved[n])
                    else:
                        delattr(keys, n)
            if wrote or _request_state(managers, request.request_id) != before:
                calls[name] = calls.get(name, 0) + 1
            return out
        return call

    # -- what the connector recorder uses (connector_recorder.RecorderHooks) ---------------
    def _pre(self, req: Any) -> tuple[Any, ...]:
        return (req, len(req._all_token_ids), len(req.block_hashes), req.num_computed_tokens,
                req.num_in_flight_tokens, self._queue.num_free_blocks)

    def sync(self, req: Any) -> None:
        """Queue the request-side ops a replay needs before a call on ``req``."""
        self._push((self.builder.sync, self._pre(req)))

    def sync_known(self, req: Any) -> None:
        """``sync`` for a request the trace holds already (skipped otherwise)."""
        self._push((self.builder.sync_known, self._pre(req)))

    def emit(self, op: dict[str, Any], expect: dict[str, Any]) -> None:
        """An op built here (the rare kinds); ``free`` is read now, encoding happens later."""
        self._push((self.builder.emit, op, expect, self._queue.num_free_blocks))

    def inside_op(self) -> _InsideOp:
        """Manager calls made inside are part of the op being recorded (not ops of their own).
        A plain context object, not a generator: the connector recorder enters it on every
        wrapped connector call."""
        return _InsideOp(self)

    @property
    def nested(self) -> bool:
        """Whether a call now is made inside an op being recorded."""
        return self._depth > 0

    def absorb_truncate(self, on: bool) -> None:
        """While on, the scheduler's ``truncate_computed_blocks`` is part of the connector's
        lookup op (``sched_lookup``), not an op of its own."""
        self._absorb_truncate = on

    def take_finish_pending(self) -> str | None:
        """The request whose finish-time hand-off (``conn_finish``) is still to be written, if
        any; taken once."""
        rid, self._finish_pending = self._finish_pending, None
        return rid

    def _hand_over(self) -> None:
        """Send the ops queued so far to the writer thread (at a step start, once there are
        ``HAND_OVER_OPS``: few hand-offs, few thread wake-ups on the step path)."""
        batch = self._batch
        self._batch = []
        self._push = self._batch.append
        self.writer.submit(batch)

    def close(self) -> None:
        """Finish the file; unmodelled calls (if any) are listed in a last ``comment``."""
        if self.closed:
            return
        with self._lock:
            self._depth += 1
            self._push((self.builder.finish, dict(self._calls)))
            self.closed = True
            last, self._batch = self._batch, []
            self.writer.close(last)

    # -- pool_state ops ---------------------------------------------------------------------
    def enable_pool_states(self) -> None:
        """Keep the hash -> boundary map that ``pool_state`` needs (costs memory per hash)."""
        self._push((self.builder.enable_pool_states,))

    def pool_state(self) -> None:
        """Write a ``pool_state`` op: the pool's refcounts, free queue and cached keys."""
        with self._lock:
            pool = self.pool
            refs = [[b.block_id, b.ref_cnt] for b in pool.blocks[1:] if b.ref_cnt > 0]
            q = pool.free_block_queue
            order, b = [], q.fake_free_list_head.next_free_block
            while b is not None and b is not q.fake_free_list_tail:
                order.append(b.block_id)
                b = b.next_free_block
            keys = [(bytes(key[:-4]), int.from_bytes(key[-4:], "big"), ids)
                    for key, ids in hash_map_entries(pool.cached_block_hash_to_block)]
            self._push((self.builder.pool_state, refs, order, keys, q.num_free_blocks))


def _request_state(managers: Any, rid: str) -> list[tuple[Any, ...]]:
    """Per manager: the request's ``REQUEST_STATE`` entries (blocks by identity) and the
    number of queued boundary hand-offs."""
    out = []
    for m in managers:
        entries = tuple(_ident(getattr(m, a, {}).get(rid)) for a in REQUEST_STATE)
        out.append((entries, len(getattr(m, "_pending_boundary_state_offloads", ()))))
    return out


def _ident(v: Any) -> Any:
    """``v`` with its blocks replaced by their identity (blocks compare field by field)."""
    if isinstance(v, tuple):
        return tuple(x if isinstance(x, int) else id(x) for x in v)
    return v


def _spy(method: Any, name: str, wrote: list[str]) -> Any:
    """``method``, noting its name in ``wrote`` when called."""
    def call(*args: Any, **kwargs: Any) -> Any:
        wrote.append(name)
        return method(*args, **kwargs)
    return call


def _request_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus


class _InsideOp:
    """``Recorder.inside_op``: the recorder's depth raised while the block runs."""

    __slots__ = ("rec",)

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def __enter__(self) -> None:
        self.rec._depth += 1

    def __exit__(self, *exc: object) -> None:
        self.rec._depth -= 1
