"""Record what a live vLLM 0.33 scheduler does to its KV cache as a tailproof-trace/1 file.

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
``finalize_partial_tail_offloads``  ``finalize_tail`` (``tails``)
``free``                          ``free`` (finished) / ``preempt`` (still running)
``evict_blocks``                  ``evict``; ``reset_prefix_cache``: ``reset`` (``ok``)
================================  =================================================

Every op also expects ``free`` (free blocks after the call). The request's side is written
lazily, right before the first manager call that depends on it: ``add_request`` when the
manager first sees a request, ``append_output`` for tokens appended since, ``commit`` /
``set_in_flight`` when ``num_computed_tokens`` / ``num_in_flight_tokens`` moved (the
scheduler's ``_update_after_schedule`` and ``update_from_output``). So a recorded trace replays
on any adapter and ``tailproof replay trace.json --against reference`` names the first op
where the model disagrees with the engine.

The handlers run on the scheduler's thread and only queue each op's values (a tuple per op);
a writer thread builds, encodes and writes the ops in order (``writer.BackgroundWriter``), so
the step path pays for no JSON, prefix sharing, run-length coding or redaction.

Manager calls the format does not model (``cache_blocks`` of async scheduling,
``pop_blocks_for_free`` of deferred frees, ``get_computed_blocks_for_connector``...) are
counted under ``provenance.unmodelled``: a trace that has any may not replay faithfully.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailproof.conformance.capture.redact import Redactor
from tailproof.conformance.capture.tokens import PrefixIndex, run_length
from tailproof.conformance.capture.writer import STEP_BOUNDARY, BackgroundWriter, TraceWriter
from tailproof.conformance.trace import FORMAT_TAG

RECORDER_VERSION = "tailproof-recorder/1"
#: ops queued on the step path before they are handed to the writer thread (at a step end)
HAND_OVER_OPS = 256

# Manager methods recorded as ops, and those counted as unmodelled when called.
RECORDED = ("new_step_starts", "get_computed_blocks", "allocate_slots",
            "truncate_computed_blocks", "take_boundary_state_offloads",
            "take_kv_cache_block_copies", "finalize_partial_tail_offloads", "free",
            "evict_blocks", "reset_prefix_cache")
UNMODELLED = ("cache_blocks", "pop_blocks_for_free", "get_computed_blocks_for_connector",
              "record_blocks_for_zeroing", "remove_skipped_blocks")


# -- op builders: run on the writer thread, from the values the step path captured ---------
# (keys in the order the ops have always been written, so captures stay byte-identical)


def _with_expect(op: dict[str, Any], expect: dict[str, Any], free: int) -> dict[str, Any]:
    expect["free"] = free
    op["expect"] = expect
    return op


def _new_step(free: int) -> bytes:
    return b'{"op":"new_step","expect":{"free":%d}}' % free


def _no_offloads(free: int) -> bytes:
    return b'{"op":"drain_offloads","expect":{"offloads":[],"free":%d}}' % free


def _no_copies(free: int) -> bytes:
    return (b'{"op":"drain_copies","expect":{"copies":[],"retained":[],"handle":null,'
            b'"free":%d}}' % free)


def _ids(groups: list[list[Any]]) -> list[list[int]]:
    """``KVCacheBlocks.get_block_ids`` of copied group lists (a block's id never changes)."""
    return [[b.block_id for b in g] for g in groups]


def _lookup(rid: str, max_len: int | None, hit: int, groups: list[list[Any]],
            free: int) -> dict[str, Any]:
    op: dict[str, Any] = {"op": "lookup", "rid": rid}
    if max_len is not None:
        op["max_len"] = max_len
    op["expect"] = {"hit": hit, "blocks": _ids(groups), "free": free}
    return op


def _allocate(rid: str, n: int, use_hit: bool, external: int, delay: bool, lookahead: int,
              new: list[list[Any]] | None, free: int) -> dict[str, Any]:
    op: dict[str, Any] = {"op": "allocate", "rid": rid, "n": n}
    if use_hit:
        op["use_hit"] = True
    if external:
        op["external"] = external
    if delay:
        op["delay_cache"] = True
    if lookahead:
        op["lookahead"] = lookahead
    op["expect"] = {"ok": new is not None,
                    "new": None if new is None else _ids(new), "free": free}
    return op


def _commit(rid: str, n: int, computed: int, free: int) -> dict[str, Any]:
    return {"op": "commit", "rid": rid, "n": n, "expect": {"computed": computed, "free": free}}


def _set_in_flight(rid: str, n: int, free: int) -> dict[str, Any]:
    return {"op": "set_in_flight", "rid": rid, "n": n, "expect": {"free": free}}


def _request_end(kind: str, rid: str, free: int) -> dict[str, Any]:
    return {"op": kind, "rid": rid, "expect": {"free": free}}


class RecorderUnsupported(ValueError):
    """An engine whose KV cache layout the trace format cannot express."""


@dataclass
class _Shadow:
    """What a replay's copy of one request holds (so the recorder writes only changes)."""

    obj: Any
    tokens: int
    computed: int = 0
    in_flight: int = 0
    pending_hit: int | None = None


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
    split = scheduler.cache_config.block_size
    if split in [g["block_size"] for g in groups]:
        cfg["split_block_size"] = split
    return cfg


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
        from tailproof.conformance.capture.connector_config import (
            ConnectorConfigError,
            connector_config,
        )

        try:
            doc["connector_config"] = connector_config(scheduler.vllm_config)
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
    """Wraps one scheduler's ``KVCacheManager`` and writes the trace as the engine runs."""

    def __init__(self, scheduler: Any, writer: TraceWriter, *, redact: bool = False,
                 compact: bool = True, config: dict[str, Any] | None = None) -> None:
        self.scheduler = scheduler
        self.mgr = scheduler.kv_cache_manager
        self.pool = self.mgr.block_pool
        self.writer = BackgroundWriter(writer)
        # The step path only appends tuples here; full lists go to the writer thread.
        self._batch: list[tuple[Any, ...]] = []
        self._push = self._batch.append
        self.config = config or config_from_scheduler(scheduler)
        self.h = self.config["hash_block_size"]
        self.block_sizes = [g["block_size"] for g in self.config["groups"]]
        self.redactor = Redactor(self.h) if redact else None
        self.prefixes = PrefixIndex(self.h)
        # Run-length coding (a pass per token, on the writer thread) can be turned off.
        self.compact = compact
        self.shadows: dict[str, _Shadow] = {}
        self.unmodelled: dict[str, int] = {}
        self.next_handle = 0
        self._last_handle: int | None = None
        self._last_lookup: str | None = None
        self._boundary_of: dict[bytes, int] | None = None  # for snapshots only
        self._depth = 0
        self._lock = threading.RLock()  # close() / snapshot() against a running engine
        self._num_free = self.pool.get_num_free_blocks
        self.closed = False
        retention = getattr(scheduler.kv_cache_config, "prefix_cache_retention_interval", None)
        if retention is not None and any(g["kind"] == "mamba_align"
                                         for g in self.config["groups"]):
            # vLLM's engine default (0) keeps Mamba checkpoints sparsely; the trace format
            # and its adapters retain densely (KVCacheConfig's default, None).
            self._unmodelled(f"sparse Mamba retention (prefix_cache_retention_interval="
                             f"{retention})")
        note = None if self.config.get("connector") else connector_note(scheduler)
        if note is not None:
            self._unmodelled(note)

    # -- installation -------------------------------------------------------------------
    @classmethod
    def attach(cls, scheduler: Any, path: str | Path, *, redact: bool = False,
               compact: bool = True, max_bytes: int | None = None, name: str | None = None,
               description: str = "", workers: list[Any] | None = None,
               store_plan: Any = None) -> Recorder:
        """Start recording ``scheduler`` into ``path`` (a trace file, streamed). ``workers``:
        the engine's worker connectors, in rank order, when they run in this process; the
        connector's calls and their store runs are then recorded as connector ops."""
        config = config_from_scheduler(scheduler)
        if workers is not None:
            from tailproof.conformance.capture.connector_config import connector_config

            conn = connector_config(scheduler.vllm_config)
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
            from tailproof.conformance.capture import connector_recorder

            connector_recorder.install(rec, workers, store_plan)
        rec.install()
        if workers is not None:
            connector_recorder.install_finish_hand_off(rec)
        return rec

    def install(self) -> None:
        mgr = self.mgr
        for name in RECORDED:
            setattr(mgr, name, self._wrap(getattr(mgr, name), getattr(self, f"_on_{name}")))
        for name in UNMODELLED:
            if hasattr(mgr, name):
                setattr(mgr, name, self._count(getattr(mgr, name), name))
        sched = self.scheduler
        sched._free_cow_retained_blocks = self._wrap(
            sched._free_cow_retained_blocks, self._on_free_cow_retained)

    def _wrap(self, orig: Any, handler: Any) -> Any:
        @functools.wraps(orig)
        def call(*args: Any, **kwargs: Any) -> Any:
            # The scheduler calls the manager from one thread; ``_depth`` keeps calls the
            # manager makes on itself (and on the scheduler) from being recorded twice.
            if self._depth:  # close() leaves it raised for good
                return orig(*args, **kwargs)
            self._depth += 1
            try:
                return handler(orig, *args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def _count(self, orig: Any, name: str) -> Any:
        @functools.wraps(orig)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._depth:
                self.unmodelled[name] = self.unmodelled.get(name, 0) + 1
            return orig(*args, **kwargs)
        return call

    # -- output -------------------------------------------------------------------------
    def _emit(self, op: dict[str, Any], expect: dict[str, Any]) -> None:
        """An op built here (the rare kinds); ``free`` is read now, encoding happens later."""
        self._push((_with_expect, op, expect, self._num_free()))

    def _hand_over(self) -> None:
        """At a step boundary: send the ops queued so far to the writer thread once there are
        ``HAND_OVER_OPS`` of them (fewer hand-offs, fewer thread wake-ups on the step path)."""
        batch = self._batch
        if len(batch) >= HAND_OVER_OPS:
            self._batch = []
            self._push = self._batch.append
            self.writer.submit(batch)

    def close(self) -> None:
        """Finish the file; unmodelled calls (if any) are listed in a last ``comment``."""
        if self.closed:
            return
        with self._lock:
            self.closed = True
            self._depth += 1
            if self.unmodelled:
                comment = {"op": "new_step", "comment": "unmodelled manager calls: "
                           + ", ".join(f"{k} x{v}" for k, v in sorted(self.unmodelled.items()))}
                self._push((dict, comment))
            last, self._batch = self._batch, []
            self.writer.close(last)

    # -- requests -----------------------------------------------------------------------
    def _redacted(self, toks: list[int], start: int, hashes: list[Any] | None,
                  root: bytes) -> list[int]:
        if self.redactor is None or hashes is None:
            return toks
        return self.redactor.tokens(toks, start, hashes, root)

    def _hashes_for_redaction(self, req: Any) -> tuple[list[Any] | None, bytes]:
        if self.redactor is None:
            return None, b""
        salt = getattr(req, "cache_salt", None)
        return list(req.block_hashes), salt.encode() if isinstance(salt, str) else b""

    def _add_request(self, rid: str, prompt: list[int], hashes: list[Any],
                     redact_hashes: list[Any] | None, root: bytes, max_tokens: int | None,
                     num_hashes: int, free: int) -> dict[str, Any]:
        prompt = self._redacted(prompt, 0, redact_hashes, root)
        op: dict[str, Any] = {"op": "add_request", "rid": rid,
                              "tokens": self.prefixes.encode(rid, prompt, hashes, self.compact)}
        if max_tokens is not None:
            op["max_tokens"] = max_tokens
        op["expect"] = {"num_hashes": num_hashes, "free": free}
        return op

    def _append_output(self, rid: str, toks: list[int], start: int,
                       redact_hashes: list[Any] | None, root: bytes, num_hashes: int,
                       free: int) -> dict[str, Any]:
        toks = self._redacted(toks, start, redact_hashes, root)
        return {"op": "append_output", "rid": rid, "tokens": self._runs(toks),
                "expect": {"num_hashes": num_hashes, "free": free}}

    def _sync(self, req: Any) -> _Shadow:
        """Write the request-side ops a replay needs before a manager call on ``req``."""
        # Only copies of what the op needs are taken here (the token lists grow); building,
        # prefix sharing, redaction and encoding run on the writer thread, in order.
        rid = req.request_id
        s = self.shadows.get(rid)
        if s is None or s.obj is not req:
            n_prompt = req.num_prompt_tokens
            hashes = req.block_hashes
            num_hashes = len(hashes) if req.num_tokens == n_prompt else n_prompt // self.h
            max_tokens = getattr(req, "max_tokens", None)
            if not (isinstance(max_tokens, int) and max_tokens >= 1 and max_tokens != 16):
                max_tokens = None
            self._push((self._add_request, rid, req.all_token_ids[:n_prompt],
                        hashes[: n_prompt // self.h], *self._hashes_for_redaction(req),
                        max_tokens, num_hashes, self._num_free()))
            s = self.shadows[rid] = _Shadow(req, n_prompt)
            self._note_hashes(req)
        n = req.num_tokens
        if n > s.tokens:
            self._push((self._append_output, rid, req.all_token_ids[s.tokens:n], s.tokens,
                        *self._hashes_for_redaction(req), len(req.block_hashes),
                        self._num_free()))
            s.tokens = n
            self._note_hashes(req)
        elif n < s.tokens:
            self._unmodelled("tokens removed from a request")
        c = req.num_computed_tokens
        if c > s.computed:
            self._push((_commit, rid, c - s.computed, c, self._num_free()))
            s.computed = c
        elif c < s.computed:
            self._unmodelled("num_computed_tokens rolled back")
        f = req.num_in_flight_tokens
        if f != s.in_flight:
            self._push((_set_in_flight, rid, f, self._num_free()))
            s.in_flight = f
        return s

    def _runs(self, tokens: list[int]) -> list[Any]:
        return run_length(tokens) if self.compact else tokens

    def _unmodelled(self, what: str) -> None:
        self.unmodelled[what] = self.unmodelled.get(what, 0) + 1

    def _note_hashes(self, req: Any) -> None:
        if self._boundary_of is None:
            return
        for k, bh in enumerate(req.block_hashes):
            self._boundary_of[bytes(bh)] = (k + 1) * self.h

    # -- handlers: each calls the real method and queues the op -------------------------
    def _on_new_step_starts(self, orig: Any) -> Any:
        self._hand_over()
        out = orig()
        self._push(STEP_BOUNDARY)
        self._push((_new_step, self._num_free()))
        return out

    def _on_get_computed_blocks(self, orig: Any, request: Any,
                                max_cache_hit_length: int | None = None) -> Any:
        s = self._sync(request)
        out = orig(request, max_cache_hit_length)
        hit = out[1]
        # Copies of the group lists (C-level); the ids are read on the writer thread.
        self._push((_lookup, request.request_id, max_cache_hit_length, hit,
                    list(map(list, out[0].blocks)), self._num_free()))
        s.pending_hit = hit
        self._last_lookup = request.request_id
        return out

    def _on_allocate_slots(self, orig: Any, request: Any, num_new_tokens: int,
                           num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                           num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                           delay_cache_blocks: bool = False, **kwargs: Any) -> Any:
        s = self._sync(request)
        use_hit = new_computed_blocks is not None and s.pending_hit is not None
        hit = s.pending_hit if use_hit else 0
        if num_new_computed_tokens != (hit or 0):
            self._unmodelled("allocate with a hit other than the last lookup's")
        if kwargs.get("reserved_blocks") or kwargs.get("num_encoder_tokens"):
            self._unmodelled("allocate_slots reservations / encoder tokens")
        out = orig(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                   num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                   **kwargs)
        if out is None and kwargs.get("full_sequence_must_fit"):
            # vLLM's admission gate (scheduler_reserve_full_isl) may have refused it; the
            # trace format has no such gate, so a replay may admit the request.
            self._unmodelled("admission refused with full_sequence_must_fit")
        self._push((_allocate, request.request_id, num_new_tokens, use_hit,
                    num_external_computed_tokens, delay_cache_blocks, num_lookahead_tokens,
                    None if out is None else list(map(list, out.blocks)), self._num_free()))
        s.pending_hit = None
        if out is not None:
            s.computed += (hit or 0) + num_external_computed_tokens
        return out

    def _on_truncate_computed_blocks(self, orig: Any, blocks: Any, num_tokens: int) -> Any:
        out = orig(blocks, num_tokens)
        # The scheduler truncates the hit it just looked up for the request it admits.
        rid = self._last_lookup
        if rid is None or self.shadows[rid].pending_hit is None:
            self._unmodelled("truncate without a pending lookup")
            return out
        self._emit({"op": "truncate", "rid": rid, "n": num_tokens},
                   {"blocks": [list(b) for b in out.get_block_ids()]})
        return out

    def _on_take_boundary_state_offloads(self, orig: Any) -> Any:
        out = orig()
        if not out:
            self._push((_no_offloads, self._num_free()))
            return out
        sizes = self.block_sizes
        self._emit({"op": "drain_offloads"}, {"offloads": [
            {"rid": rid, "group": g, "boundary": b, "block": blk,
             "kind": "tail" if b % sizes[g] else "aligned"}
            for rid, entries in out.items() for g, blk, b in entries]})
        return out

    def _on_take_kv_cache_block_copies(self, orig: Any) -> Any:
        out = orig()
        copies, retained = out
        if not copies and not retained:
            self._last_handle = None
            self._push((_no_copies, self._num_free()))
            return out
        handle = None
        if retained:
            handle = self.next_handle
            self.next_handle += 1
        self._last_handle = handle
        self._emit({"op": "drain_copies"}, {
            "copies": [[c.src_block_id, c.dst_block_id] for c in copies],
            "retained": [b.block_id for b in retained], "handle": handle})
        return out

    def _on_free_cow_retained(self, orig: Any, blocks: Any, fence_seq: int) -> Any:
        sched = self.scheduler
        immediate = not sched.defer_block_free or fence_seq <= sched.processed_step_seq
        out = orig(blocks, fence_seq)
        if not immediate or self._last_handle is None:
            self._unmodelled("deferred CoW retention release")
            return out
        ids = [b.block_id for b in blocks]
        self._emit({"op": "release_retained", "handle": self._last_handle}, {"released": ids})
        self._last_handle = None
        return out

    def _on_finalize_partial_tail_offloads(self, orig: Any, request: Any) -> Any:
        self._sync(request)
        out = orig(request)
        self._emit({"op": "finalize_tail", "rid": request.request_id},
                   {"tails": [{"group": g, "boundary": b, "block": blk} for g, blk, b in out]})
        return out

    def _on_free(self, orig: Any, request: Any) -> Any:
        s = self._sync(request)
        finished = request.is_finished()
        out = orig(request)
        rid = request.request_id
        self._push((_request_end, "free" if finished else "preempt", rid, self._num_free()))
        s.pending_hit = None
        if finished:
            del self.shadows[rid]
        else:
            s.computed = 0
        return out

    def _on_evict_blocks(self, orig: Any, block_ids: set[int]) -> Any:
        out = orig(block_ids)
        ids = sorted(block_ids)
        self._emit({"op": "evict", "blocks": ids}, {"evicted": ids})
        return out

    def _on_reset_prefix_cache(self, orig: Any) -> Any:
        out = orig()
        self._emit({"op": "reset"}, {"ok": bool(out)})
        return out

    # -- snapshots ----------------------------------------------------------------------
    def enable_snapshots(self) -> None:
        """Keep the hash -> boundary map that ``snapshot`` needs (costs memory per hash)."""
        if self._boundary_of is None:
            self._boundary_of = {}
            for s in self.shadows.values():
                self._note_hashes(s.obj)

    def snapshot(self) -> None:
        """Write a ``snapshot`` op: the pool's refcounts, free queue and cached keys."""
        self.enable_snapshots()
        assert self._boundary_of is not None
        with self._lock:
            pool = self.pool
            refs = [[b.block_id, b.ref_cnt] for b in pool.blocks[1:] if b.ref_cnt > 0]
            q = pool.free_block_queue
            order, b = [], q.fake_free_list_head.next_free_block
            while b is not None and b is not q.fake_free_list_tail:
                order.append(b.block_id)
                b = b.next_free_block
            keys = []
            for key, val in pool.cached_block_hash_to_block._cache.items():
                group = int.from_bytes(key[-4:], "big")
                boundary = self._boundary_of.get(bytes(key[:-4]))
                if boundary is None:
                    self._unmodelled("snapshot key of an unknown hash")
                    continue
                blocks = val.values() if isinstance(val, dict) else [val]
                keys.extend([group, boundary, blk.block_id] for blk in blocks)
            self._emit({"op": "snapshot"},
                       {"refcounts": refs, "free_queue": order, "keys": sorted(keys)})
