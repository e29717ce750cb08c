"""The recorder's writer-thread half: turn the raw tuples the step path queued into trace ops.

The scheduler's thread only queues, per manager call, the request object, the four numbers
that say where the request stood (tokens, block hashes, computed and in-flight tokens), the
call's arguments and result and the free-block count (``recorder.Recorder``). Everything
else runs here, in queue order, on the writer thread: the shadow of each request that
decides which request-side ops (``add_request``, ``append_output``, ``commit``,
``set_in_flight``) a replay needs before the call, the pending hit an ``allocate`` adopts, the
retention handles, prefix sharing, redaction, run-length coding and JSON encoding.

Reading token ids and block hashes here, after the call, is exact because vLLM 0.33 only
appends to ``Request._all_token_ids`` and ``Request.block_hashes`` (the slice up to the count
taken at the call is what the engine had) -- except for streaming sessions
(``Scheduler._update_request_as_session`` truncates both), which are listed as unmodelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailproof.conformance.capture.redact import Redactor
from tailproof.conformance.capture.tokens import PrefixIndex, run_length

# vLLM 0.33's default SamplingParams.max_tokens: not written (the trace's default too)
_DEFAULT_MAX_TOKENS = 16


@dataclass
class _Shadow:
    """What a replay's copy of one request holds (so only changes are written)."""

    obj: Any
    tokens: int
    computed: int = 0
    in_flight: int = 0
    pending_hit: int | None = None


def _ids(groups: Any) -> list[list[int]]:
    """``KVCacheBlocks.get_block_ids`` of a result's group lists (a block's id never
    changes, and vLLM does not mutate a returned block list)."""
    return [[b.block_id for b in g] for g in groups]


def _lookup_args(request: Any, max_cache_hit_length: int | None = None) -> int | None:
    return max_cache_hit_length


def _allocate_args(request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                   new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                   num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                   num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                   reserved_blocks: int = 0, **_: Any) -> tuple[Any, ...]:
    """``KVCacheManager.allocate_slots``'s arguments, by name (vLLM 0.33 signature)."""
    return (num_new_tokens, num_new_computed_tokens, new_computed_blocks is not None,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            reserved_blocks, num_encoder_tokens, full_sequence_must_fit)


#: ``pre``: what the step path read from a request right before a manager call
#: (request, tokens, block hashes, computed tokens, in-flight tokens, free blocks)
Pre = tuple[Any, int, int, int, int, int]


class OpBuilder:
    """Writes the ops of one recording to ``out`` (a ``writer.TraceWriter``), in order."""

    def __init__(self, out: Any, h: int, block_sizes: list[int], *, redact: bool,
                 compact: bool) -> None:
        self.out = out
        self.h = h
        self.block_sizes = block_sizes
        self.redactor = Redactor(h) if redact else None
        self.prefixes = PrefixIndex(h)
        self.compact = compact  # run-length coding can be turned off
        self.shadows: dict[str, _Shadow] = {}
        self.unmodelled: dict[str, int] = {}
        self.next_handle = 0
        self.last_handle: int | None = None
        self.last_lookup: str | None = None
        self.boundary_of: dict[bytes, int] | None = None  # for pool_state ops only

    # -- output -------------------------------------------------------------------------
    def _write(self, op: dict[str, Any], expect: dict[str, Any], free: int) -> None:
        expect["free"] = free
        op["expect"] = expect
        self.out.write(op)

    def emit(self, op: dict[str, Any], expect: dict[str, Any], free: int) -> None:
        """An op built on the step path (the rare kinds): ``free`` was read there."""
        self._write(op, expect, free)

    def unmodelled_call(self, what: str) -> None:
        self.unmodelled[what] = self.unmodelled.get(what, 0) + 1

    def finish(self, calls: dict[str, int]) -> None:
        """The last op: unmodelled calls (if any) listed in a ``comment``."""
        for k, v in calls.items():
            self.unmodelled[k] = self.unmodelled.get(k, 0) + v
        if self.unmodelled:
            self.out.write({"op": "new_step", "comment": "unmodelled manager calls: "
                            + ", ".join(f"{k} x{v}" for k, v in sorted(self.unmodelled.items()))})

    # -- requests -----------------------------------------------------------------------
    def _redacted(self, toks: list[int], start: int, req: Any, nh: int) -> list[int]:
        if self.redactor is None:
            return toks
        salt = getattr(req, "cache_salt", None)
        root = salt.encode() if isinstance(salt, str) else b""
        return self.redactor.tokens(toks, start, req.block_hashes[:nh], root)

    def _runs(self, tokens: list[int]) -> list[Any]:
        return run_length(tokens) if self.compact else tokens

    def _note_hashes(self, req: Any, nh: int) -> None:
        if self.boundary_of is None:
            return
        h = self.h
        for k, bh in enumerate(req.block_hashes[:nh]):
            self.boundary_of[bytes(bh)] = (k + 1) * h

    def _shadow(self, pre: Pre) -> _Shadow:
        """Write the request-side ops a replay needs before a manager call on the request."""
        req, n, nh, c, f, free = pre
        rid = req.request_id
        s = self.shadows.get(rid)
        if s is None or s.obj is not req:
            if getattr(req, "resumable", False):
                self.unmodelled_call("streaming session request (token lists rewritten)")
            n_prompt = req.num_prompt_tokens
            num_hashes = nh if n == n_prompt else n_prompt // self.h
            max_tokens = getattr(req, "max_tokens", None)
            if not (isinstance(max_tokens, int) and max_tokens >= 1
                    and max_tokens != _DEFAULT_MAX_TOKENS):
                max_tokens = None
            prompt = self._redacted(req._all_token_ids[:n_prompt], 0, req, nh)
            op: dict[str, Any] = {"op": "add_request", "rid": rid, "tokens": self.prefixes.encode(
                rid, prompt, req.block_hashes[: n_prompt // self.h], self.compact)}
            if max_tokens is not None:
                op["max_tokens"] = max_tokens
            self._write(op, {"num_hashes": num_hashes}, free)
            s = self.shadows[rid] = _Shadow(req, n_prompt)
            self._note_hashes(req, nh)
        if n > s.tokens:
            toks = self._redacted(req._all_token_ids[s.tokens:n], s.tokens, req, nh)
            self._write({"op": "append_output", "rid": rid, "tokens": self._runs(toks)},
                        {"num_hashes": nh}, free)
            s.tokens = n
            self._note_hashes(req, nh)
        elif n < s.tokens:
            self.unmodelled_call("tokens removed from a request")
        if c > s.computed:
            self.out.write({"op": "commit", "rid": rid, "n": c - s.computed,
                            "expect": {"computed": c, "free": free}})
            s.computed = c
        elif c < s.computed:
            self.unmodelled_call("num_computed_tokens rolled back")
        if f != s.in_flight:
            self.out.write({"op": "set_in_flight", "rid": rid, "n": f, "expect": {"free": free}})
            s.in_flight = f
        return s

    def sync(self, pre: Pre) -> None:
        """The request-side ops alone (before a connector call on the request)."""
        self._shadow(pre)

    def sync_known(self, pre: Pre) -> None:
        """``sync`` for a request the trace already holds (skipped otherwise)."""
        if pre[0].request_id in self.shadows:
            self._shadow(pre)

    # -- manager calls ------------------------------------------------------------------
    def new_step(self, free: int) -> None:
        self.out.step_boundary()  # a segment may start here
        self.out.write_raw(b'{"op":"new_step","expect":{"free":%d}}' % free)

    def lookup(self, pre: Pre, a: tuple[Any, ...], k: dict[str, Any], out: Any,
               free: int) -> None:
        s = self._shadow(pre)
        rid = pre[0].request_id
        max_len = _lookup_args(*a, **k)
        hit = out[1]
        op: dict[str, Any] = {"op": "lookup", "rid": rid}
        if max_len is not None:
            op["max_len"] = max_len
        op["expect"] = {"hit": hit, "blocks": _ids(out[0].blocks), "free": free}
        self.out.write(op)
        s.pending_hit = hit
        self.last_lookup = rid

    def allocate(self, pre: Pre, a: tuple[Any, ...], k: dict[str, Any], out: Any,
                 free: int) -> None:
        s = self._shadow(pre)
        (n, n_computed, has_blocks, lookahead, external, delay, reserved, encoder,
         must_fit) = _allocate_args(*a, **k)
        use_hit = has_blocks and s.pending_hit is not None
        hit = s.pending_hit if use_hit else 0
        if n_computed != (hit or 0):
            self.unmodelled_call("allocate with a hit other than the last lookup's")
        if encoder:
            self.unmodelled_call("allocate_slots encoder tokens")
        if out is None and must_fit:
            # vLLM's admission gate (scheduler_reserve_full_isl) may have refused it; the
            # trace format has no such gate, so a replay may admit the request.
            self.unmodelled_call("admission refused with full_sequence_must_fit")
        op: dict[str, Any] = {"op": "allocate", "rid": pre[0].request_id, "n": n}
        if use_hit:
            op["use_hit"] = True
        if external:
            op["external"] = external
        if delay:
            op["delay_cache"] = True
        if lookahead:
            op["lookahead"] = lookahead
        if reserved:
            op["reserved"] = reserved
        op["expect"] = {"ok": out is not None,
                        "new": None if out is None else _ids(out.blocks), "free": free}
        self.out.write(op)
        s.pending_hit = None
        if out is not None:
            s.computed += (hit or 0) + external

    def truncate(self, num_tokens: int, out: Any, free: int) -> None:
        # The scheduler truncates the hit it just looked up for the request it admits.
        rid = self.last_lookup
        if rid is None or self.shadows[rid].pending_hit is None:
            self.unmodelled_call("truncate without a pending lookup")
            return
        self._write({"op": "truncate", "rid": rid, "n": num_tokens},
                    {"blocks": [list(b) for b in out.get_block_ids()]}, free)

    def offloads(self, out: dict[str, Any], free: int) -> None:
        if not out:
            self.out.write_raw(b'{"op":"drain_offloads","expect":{"offloads":[],"free":%d}}'
                               % free)
            return
        sizes = self.block_sizes
        self._write({"op": "drain_offloads"}, {"offloads": [
            {"rid": rid, "group": g, "boundary": b, "block": blk,
             "kind": "tail" if b % sizes[g] else "aligned"}
            for rid, entries in out.items() for g, blk, b in entries]}, free)

    def copies(self, out: Any, free: int) -> None:
        copies, retained = out
        if not copies and not retained:
            self.last_handle = None
            self.out.write_raw(b'{"op":"drain_copies","expect":{"copies":[],"retained":[],'
                               b'"handle":null,"free":%d}}' % free)
            return
        handle = None
        if retained:
            handle = self.next_handle
            self.next_handle += 1
        self.last_handle = handle
        self._write({"op": "drain_copies"}, {
            "copies": [[c.src_block_id, c.dst_block_id] for c in copies],
            "retained": [b.block_id for b in retained], "handle": handle}, free)

    def release_retained(self, immediate: bool, blocks: tuple[Any, ...], free: int) -> None:
        if not immediate or self.last_handle is None:
            self.unmodelled_call("deferred CoW retention release")
            return
        self._write({"op": "release_retained", "handle": self.last_handle},
                    {"released": [b.block_id for b in blocks]}, free)
        self.last_handle = None

    def finalize_tail(self, pre: Pre, out: Any, free: int) -> None:
        self._shadow(pre)
        self._write({"op": "finalize_tail", "rid": pre[0].request_id},
                    {"tails": [{"group": g, "boundary": b, "block": blk} for g, blk, b in out]},
                    free)

    def free(self, pre: Pre, finished: bool, free: int) -> None:
        s = self._shadow(pre)
        rid = pre[0].request_id
        self.out.write({"op": "free" if finished else "preempt", "rid": rid,
                        "expect": {"free": free}})
        s.pending_hit = None
        if finished:
            del self.shadows[rid]
        else:
            s.computed = 0

    def remote_kv_ready(self, pre: Pre, computed: int, free: int) -> None:
        """``Scheduler._update_waiting_for_remote_kv`` for a load that landed: its blocks
        cached up to the computed tokens (``computed``: the count it left)."""
        s = self._shadow(pre)
        self.out.write({"op": "remote_kv_ready", "rid": pre[0].request_id,
                        "expect": {"computed": computed, "free": free}})
        s.computed = computed

    # -- pool_state ops ---------------------------------------------------------------------
    def enable_pool_states(self) -> None:
        """Keep the hash -> boundary map that ``pool_state`` needs (costs memory per hash)."""
        if self.boundary_of is None:
            self.boundary_of = {}
            for s in self.shadows.values():
                self._note_hashes(s.obj, len(s.obj.block_hashes))

    def pool_state(self, refs: list[list[int]], order: list[int],
                 keys: list[tuple[bytes, int, list[int]]], free: int) -> None:
        """A ``pool_state`` op from the pool state read on the step path: ``keys`` holds
        (block hash, group, block ids) of each cached key."""
        assert self.boundary_of is not None
        out = []
        for bh, group, ids in keys:
            boundary = self.boundary_of.get(bh)
            if boundary is None:
                self.unmodelled_call("pool_state key of an unknown hash")
                continue
            out.extend([group, boundary, i] for i in ids)
        self._write({"op": "pool_state"},
                    {"refcounts": refs, "free_queue": order, "keys": sorted(out)}, free)
