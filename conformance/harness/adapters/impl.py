"""Connector adapter over the production connector (``tailproof.impl``), with real KV bytes.

- core: vLLM 0.33's real ``KVCacheManager`` (``VllmCoreBackend``); the connector's scheduler
  role (``SchedulerSide``) pins blocks of its real ``BlockPool``;
- workers: one ``WorkerSide`` per rank over real torch KV tensors (``SimRunner`` layouts; on
  CUDA when available, else CPU; the ``device`` option overrides), its store jobs queued by
  ``conn_step`` and run by ``worker_run`` on the worker's real sender thread (manual lanes:
  ``worker_run`` hands it exactly the jobs it names and waits for them; loads likewise on the
  receiver thread, run right after the step that scheduled them);
- store: a real store (``make_store``: the ``store`` option, ``memory`` by default or
  ``mooncake`` with ``store_config={"master_address": ...}``) behind :class:`ScriptedStore`,
  which applies the trace's scripted put outcomes and keeps the observation tags.

Options come from ``make_driver(name, config, options)`` (the CLI's ``--store`` /
``--mooncake-master`` / ``--device``).

Data integrity: the adapter is the core backend's ``KVObserver``: every committed chunk is
"computed" by writing bytes derived from (rank, layer, group, token prefix) into the request's
blocks, and every CoW copy is applied to the tensors as soon as the core queues it.
Each put is then checked byte for byte against what its key's prefix must hold, and each load
(run right after the step that scheduled it) against what the loading request's prefix must
be; reading a CoW source instead of its target, a stale block or a wrong offset raises
:class:`KVByteMismatch`, which the driver records as ``{"error": "KVByteMismatch"}`` -- a
divergence from the reference, which never errs there.
"""

from __future__ import annotations

import json
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from tailproof.conformance.format.connector_config import EXTENSION_FIELDS
from tailproof.conformance.harness.adapters.base import (
    KV_ROLE,
    ConnectorAdapter,
    ConnStep,
    Tag,
    kv_blocks,
    store_context,
)
from tailproof.conformance.harness.adapters.runner_sim import GroupShape, SimRunner
from tailproof.conformance.harness.adapters.vllm_core import scheduler_output
from tailproof.conformance.harness.driver import StepContext
from tailproof.impl.config import Settings, StoreGeometry
from tailproof.impl.connector import TailproofConnector, build_coordinator
from tailproof.impl.fingerprint import geometry_fingerprint
from tailproof.impl.keys import KeySpace, parse_key
from tailproof.impl.kv_layout import KVLayout
from tailproof.impl.lookup import StoreLookup
from tailproof.impl.meta import TailproofMeta, TailproofWorkerMeta
from tailproof.impl.scheduler_side import SchedulerSide
from tailproof.impl.stores import Outcome, Store, make_store
from tailproof.impl.value_format import HEADER_BYTES, slot_nbytes
from tailproof.impl.worker_side import WorkerSide
from tailproof.reference.connector.store import check_script, codes_for

NAMESPACE = "conf"


class KVByteMismatch(AssertionError):
    """A put or load moved bytes that are not the KV of the key's / request's prefix."""


class ScriptedStore(Store):
    """A real store behind the trace's put script and the observation bookkeeping.

    Each ``put_batch`` consumes one script entry (``reference.connector.store`` semantics):
    keys scripted to fail answer STORE_FULL (-200) or ERROR without reaching the real store; the
    others are put for real. ``tags`` holds every key the trace put or seeded and not removed
    (a removed key answers absent / MISS even where the real store keeps its bytes).
    """

    name = "scripted"

    def __init__(self, inner: Store, verify: Any, tp_size: int = 1) -> None:
        self.inner = inner
        self.tp_size = tp_size
        self.verify = verify  # (key, tag, buffer) -> None, raises nothing, records problems
        self.tags: dict[str, Tag] = {}
        self.removed = 0  # tags dropped here (store_remove, remove): removal_count's share
        self.retagged = 0  # tags added or dropped here: change_count's share
        self.script: deque[Any] = deque()
        self.log: list[tuple[list[Tag], Any]] = []
        self.context: tuple[str, dict[str, int]] = ("", {})  # writer rid, hash hex -> boundary

    def set_script(self, script: list[Any]) -> None:
        self.script = deque(check_script(script))

    def tag(self, key: str) -> Tag:
        rid, boundary_of = self.context
        k = parse_key(key)
        rank = k.tp_rank + k.pp_rank * self.tp_size
        return rank, k.group, boundary_of[k.block_hash.hex()], rid

    def exists(self, keys: Sequence[str]) -> list[bool]:
        real = self.inner.exists(list(keys))
        return [k in self.tags and r for k, r in zip(keys, real, strict=True)]

    def _scripted(self, keys: Sequence[str]) -> tuple[list[Any], list[Outcome], list[int]]:
        """Take the next scripted answer for a put of ``keys``: their tags, the outcomes of the
        refused keys (the rest are filled by the inner store) and the indexes that go through."""
        entry = self.script.popleft() if self.script else "ok"
        tags = [self.tag(k) for k in keys]
        self.log.append((tags, entry))
        codes = codes_for(entry, len(keys))
        if codes is None:  # a raising store call: every key fails
            return tags, [Outcome.error(message="scripted raise")] * len(keys), []
        outs: list[Outcome] = [Outcome.error()] * len(keys)
        for i, c in enumerate(codes):
            if c < 0:
                outs[i] = Outcome.full(c) if c == -200 else Outcome.error(c)
        return tags, outs, [i for i, c in enumerate(codes) if c >= 0]

    def put_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        tags, outs, go = self._scripted(keys)
        if go:
            real = self.inner.put_batch([keys[i] for i in go], [buffers[i] for i in go])
            for i, o in zip(go, real, strict=True):
                outs[i] = o
                if o.saved:
                    self.verify(keys[i], tags[i], buffers[i])
                    self._retag(keys[i], tags[i])
        return outs

    def write_batch(self, keys: Sequence[str], sizes: Sequence[int], produce: Any,
                    staging: Any = None) -> list[Outcome]:
        """As :meth:`put_batch`, on the inner store's one-pass path: the bytes a key's value
        is produced with are checked as they are written."""
        tags, outs, go = self._scripted(keys)

        def checked(j: int, out: Any) -> None:
            i = go[j]
            produce(i, out)
            self.verify(keys[i], tags[i], out)

        if go:
            real = self.inner.write_batch([keys[i] for i in go], [sizes[i] for i in go],
                                          checked, staging)
            for i, o in zip(go, real, strict=True):
                outs[i] = o
                if o.saved:
                    self._retag(keys[i], tags[i])
        return outs

    def _retag(self, key: str, tag: Tag) -> None:
        """Tag ``key`` (a change when it was not tagged)."""
        self.retagged += key not in self.tags
        self.tags[key] = tag

    def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[Outcome]:
        outs = self.inner.get_batch(list(keys), list(buffers))
        return [o if k in self.tags else Outcome.miss() for k, o in zip(keys, outs, strict=True)]

    def read_batch(self, keys: Sequence[str], sizes: Sequence[int], consume: Any,
                   staging: Any = None) -> list[Outcome]:
        if all(k in self.tags for k in keys):
            return self.inner.read_batch(list(keys), list(sizes), consume, staging)
        return [Outcome.error(message="batch not read: another key missed") if k in self.tags
                else Outcome.miss() for k in keys]

    def remove(self, keys: Sequence[str]) -> int:
        for k in keys:
            gone = self.tags.pop(k, None) is not None
            self.removed += gone
            self.retagged += gone
        return self.inner.remove(list(keys))

    def remove_all(self) -> int:
        self.removed += len(self.tags)
        self.retagged += len(self.tags)
        self.tags.clear()
        return self.inner.remove_all()

    def removal_count(self) -> int | None:
        """This wrapper's removals plus the inner store's. The trace's own removals
        (``store_remove``) pass through here, so they are reported even over a store that
        cannot count its own (Mooncake: its evictions stay unseen, and a remembered hit it
        evicted fails its load closed; the corpus's pools never evict)."""
        inner = self.inner.removal_count()
        return self.removed + (inner or 0)

    def change_count(self) -> int | None:
        """This wrapper's tag changes plus the inner store's; None when the inner store cannot
        tell (Mooncake): ``exists`` here is "tagged here and held there"."""
        inner = self.inner.change_count()
        return None if inner is None else self.retagged + inner

    def close(self) -> None:
        self.inner.close()


_SHARED_MOONCAKE: dict[str, Store] = {}


def _inner_store(kind: str, extra: dict[str, Any]) -> Store:
    """A fresh memory store per trace; one Mooncake client per process (traces are kept
    apart by a per-trace key namespace)."""
    cfg = {"backend": kind, **extra}
    if kind != "mooncake":
        return make_store(cfg)
    key = json.dumps(cfg, sort_keys=True)
    if key not in _SHARED_MOONCAKE:
        _SHARED_MOONCAKE[key] = make_store(cfg)
    return _SHARED_MOONCAKE[key]


def close_shared_stores() -> None:
    """Close the per-process Mooncake clients (before their master goes away)."""
    while _SHARED_MOONCAKE:
        _, store = _SHARED_MOONCAKE.popitem()
        store.close()


def _release(workers: list[WorkerSide], store: Store | None) -> None:
    """Stop every rank's threads (queued jobs are reported, never run: a finished trace does
    no more store I/O), release their staging pools and drop their KV tensors; close the
    trace's own store (a per-trace memory store; never the shared Mooncake client)."""
    for ws in workers:
        ws.close(timeout=0.0)
    workers.clear()
    if store is not None:
        store.close()


class _WeakVerify:
    """The adapter's put check, held weakly by the store: the store lives as long as the
    workers' threads, and a strong reference from it would keep the adapter -- and through
    it the trace's tensors and threads -- alive for ever (the finalizer's arguments)."""

    def __init__(self, adapter: ImplConnector) -> None:
        self.ref = weakref.ref(adapter)

    def __call__(self, key: str, tag: Tag, buf: Any) -> None:
        adapter = self.ref()
        if adapter is not None:
            adapter._verify_put(key, tag, buf)


class ImplConnector(ConnectorAdapter):
    """The ``impl`` adapter's connector half (see module docstring). ``options``: ``store``
    (memory | mooncake), ``store_config`` (e.g. ``{"master_address": ...}``), ``device``.
    It keeps the core backend as the backend's ``KVObserver`` (forwards and CoW copies reach
    it outside any connector op); connector ops read the scheduler through their context."""

    def __init__(self, config: Any, core_backend: Any,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        options = options or {}
        self.core = core_backend
        kv_config = core_backend.kv_cache_config
        n = self.conf["num_workers"]
        groups = list(config.groups)
        geo = StoreGeometry(
            core_group_ids=tuple(range(len(groups))),
            block_sizes=tuple(g.block_size for g in groups),
            is_mamba=tuple(bool(g.is_mamba) for g in groups),
            hash_block_size=config.hash_block_size,
            scheduler_block_size=config.scheduler_block_size,
            partial_hits=core_backend.partial_hits,
            use_eagle=bool(config.use_eagle), num_blocks=config.num_blocks,
            window_group_ids=frozenset(i for i, g in enumerate(groups)
                                       if g.kind == "sliding_window"),
            tables_append_only=all(g.kind == "full_attention" for g in groups
                                   if not g.is_mamba))
        self.coord = build_coordinator(geo, kv_config, 1)
        self.geo = geo = replace(geo, eagle_group_ids=frozenset(self.coord.eagle_group_ids))
        kind = options.get("store") or "memory"
        extra = dict(options.get("store_config") or {})
        ns = f"{NAMESPACE}-{uuid.uuid4().hex[:10]}"
        self.settings = Settings(
            kv_role=KV_ROLE[self.conf["role"]], store=kind, namespace=ns,
            put_batch_size=1 << 20, staging_buffer_bytes=8 << 20,
            enable_lookup=self.conf["enable_lookup"], load_async=self.conf["load_async"],
            save_decode_cache=self.conf["save_decode_cache"],
            **{k: self.conf.get(k, default) for k, (_, default) in EXTENSION_FIELDS.items()})
        self.byte_errors: list[str] = []
        self.offsets: dict[int, int] = {}  # saved offsets taken with the completed saves
        self.job_tokens: dict[int, list[int]] = {}
        self.current_job: int | None = None
        # EXTENSION (docs/reuse.md): the last conn_step's snapshots, and those whose copies
        # wait for the step's forward (the commits after the conn_step; see step_starts).
        self.last_snapshots: list[Any] = []
        self.pending_snapshots: list[Any] = []
        inner = _inner_store(kind, extra)
        self.store = ScriptedStore(inner, _WeakVerify(self), n)
        self.keys = KeySpace(ns, geometry_fingerprint(geo).digest, n)
        self.lookup_client = StoreLookup(geo, self.coord, self.store.exists, self.keys, n,
                                         self.store.removal_count,
                                         self.store.change_count)
        self.sched = SchedulerSide(self.settings, geo, self.lookup_client, n)
        self.sched.bind_gpu_block_pool(core_backend.block_pool)
        split = core_backend.split_scheduler
        if self.junctions and split is not None:
            # EXTENSION (docs/junctions.md, "The hook"): what the vLLM plugin does once the
            # Scheduler is built -- impl's own hook sets the split's exact junction stop and
            # the extension's exact junction stops (or refuses, without partial hits).
            TailproofConnector.on_scheduler_built(
                SimpleNamespace(scheduler_side=self.sched, settings=self.settings), split)
        shapes = [GroupShape("mamba" if g.is_mamba else g.kind, g.block_size) for g in groups]
        device = options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.runners = [SimRunner(shapes, config.num_blocks, rank=r, device=device)
                        for r in range(n)]
        self.workers = []
        for r, runner in enumerate(self.runners):
            ws = WorkerSide(self.settings, geo, self.store, r, n, self.coord, tp_size=n,
                            manual=True, keep_load_outcomes=True)
            ws.register_kv_caches(runner.kv, runner.layer_names)
            self.workers.append(ws)
        # The workers' threads outlive a trace unless stopped: ``close`` (the driver's, at
        # the end of every replay) stops them; the finalizer does it for a caller that never
        # closes. Its arguments must not reach ``self`` (_WeakVerify), or it never runs.
        self._release = weakref.finalize(self, _release, list(self.workers),
                                         None if kind == "mooncake" else inner)
        core_backend.observer = self

    def close(self) -> None:
        """The trace is over: release everything it allocated (threads, staging, KV tensors,
        its memory store) now, not when the garbage collector gets to it. Idempotent."""
        self._release()
        self.workers = []
        self.runners = []
        self.job_tokens.clear()
        if getattr(self.core, "observer", None) is self:
            self.core.observer = None

    # --- KV simulation (KVObserver): forwards on commit, CoW copies when queued ----------

    def step_starts(self) -> None:
        """The previous step is over (its forward, the commits after its ``conn_step``, has
        run): every worker makes that step's snapshot copies now (``WorkerSide.copy_snapshots``,
        what ``wait_for_save`` does after the forward, before queuing the step's jobs; the jobs
        were queued at ``conn_step``, and none of them reads a slot a copy writes: a flush job
        is emitted only after the request's last snapshot). Called at ``new_step``, before
        every connector op and before the next step's CoW copies."""
        if not self.pending_snapshots:
            return
        meta = TailproofMeta(snapshots=self.pending_snapshots)
        self.pending_snapshots = []
        for ws in self.workers:
            ws.copy_snapshots(meta)

    def apply(self, op: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
        self.step_starts()
        return super().apply(op, ctx)

    def copies(self, pairs: list[tuple[int, int]]) -> None:
        """Run each CoW copy as soon as it is queued: before this step's forward, as vLLM's
        worker does (copies precede the forward, and nothing writes in between)."""
        self.step_starts()
        for runner in self.runners:
            runner.copy_blocks(pairs)

    def computed(self, rid: str, start: int, end: int) -> None:
        req = self.core.requests[rid]
        tables = self.core.table(rid)
        for runner in self.runners:
            runner.forward(rid, req.all_token_ids, start, min(end, req.num_tokens), tables)

    def _verify_put(self, key: str, tag: Tag, buf: Any) -> None:
        rank, group, boundary, rid = tag
        tokens = self.job_tokens.get(self.current_job)
        if tokens is None:
            tokens = list(self.core.requests[rid].all_token_ids)
        data = torch.as_tensor(buf).reshape(-1).view(torch.uint8)[HEADER_BYTES:]
        bad = self.runners[rank].check_block_bytes(group, data.clone(), tokens, boundary,
                                                   f"job{self.current_job}")
        self.byte_errors += [f"put {rid} {tag}: {b}" for b in bad]

    def _raise_byte_errors(self) -> None:
        if self.byte_errors:
            errs, self.byte_errors = self.byte_errors, []
            raise KVByteMismatch("; ".join(errs[:3]))

    def _snapshot(self, job_id: int, req: Any) -> None:
        """The writer's tokens as of the job (a request id may be reused later)."""
        self.job_tokens[job_id] = list(req.all_token_ids)

    # --- scheduler side ----------------------------------------------------------------

    def after_alloc(self, req: Any, table: tuple[list[int], ...], external: int) -> None:
        self.sched.update_state_after_alloc(req, kv_blocks(table), external)

    def build(self, step: ConnStep) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        meta = self.sched.build_connector_meta(scheduler_output(step))
        self.last_snapshots = list(meta.snapshots)
        self.pending_snapshots = list(meta.snapshots)
        for j in meta.stores:
            if j.store_job_id not in self.job_tokens:
                self._snapshot(j.store_job_id, step.ctx.request(j.req_id))
        jobs = [self.job_obs(j) for j in meta.stores]
        loads = [{"rid": j.req_id, "local": j.vllm_cached_tokens,
                  "external": j.kvpool_cached_tokens}
                 for j in meta.loads]
        for ws in self.workers:
            if self.settings.can_put:
                for job in meta.stores:
                    ws.add_request(job)
            ws.close_ended_store_requests(set(step.finished), set(step.preempted))
        self._run_loads(meta, step.ctx)
        return jobs, loads

    def _run_loads(self, meta: TailproofMeta, ctx: StepContext) -> None:
        """Execute this step's loads on every rank and check the loaded bytes."""
        if not meta.loads:
            return
        lcm = self.geo.scheduler_block_size
        for ws, runner in zip(self.workers, self.runners, strict=True):
            ws.start_load(TailproofMeta(loads=meta.loads))
            ws.run_loads()  # the receiver thread runs them; this waits for every one
            ws.take_transfer_results()
            ws.take_load_error_blocks()
            for job in meta.loads:
                if not ws.load_ok.pop(job.req_id):
                    continue  # failed closed: nothing was written
                req = ctx.request(job.req_id)
                start = job.vllm_cached_tokens // lcm * lcm
                bad = runner.check(job.req_id, req.all_token_ids, start, job.kvpool_cached_tokens,
                                   job.block_ids)
                self.byte_errors += [f"load {job.req_id}: {b}" for b in bad]
        self._raise_byte_errors()

    def held(self) -> dict[int, tuple[list[int], int]]:
        return self.sched.held

    def register(self, req: Any, block_ids: tuple[list[int], ...],
                 tails: list[tuple[int, int, int]]) -> dict[str, Any] | None:
        # Same shape as vllm_mooncake's: SchedulerSide mirrors MooncakeStoreScheduler's API.
        before = self.sched.next_store_job_id
        delay = self.sched.register_finished_partial_tail(req, block_ids, tails)
        assert delay is False
        if self.sched.next_store_job_id == before:
            return None
        s = self.sched.finished_partial_tails[req.request_id]
        self._snapshot(s.store_job_id, req)
        return self.job_obs(s)

    def snapshots(self) -> list[tuple[str, int, int, int, int]]:
        return [(s.req_id, s.group, s.src_block, s.slot_block, s.boundary)
                for s in self.last_snapshots]

    def finish_turn(self, req: Any, block_ids: tuple[list[int], ...]) -> dict[str, Any] | None:
        job = self.sched.finish_turn(req, block_ids)
        if job is None:
            return None
        self._snapshot(job.store_job_id, req)
        return self.job_obs(job)

    def slots(self) -> dict[str, tuple[list[int], int]]:
        return self.sched.ext.snapshot_slots()

    def junction_targets(self) -> dict[str, int]:
        return self.sched.ext.junction_stops()

    def request_trackers(self) -> dict[str, Any]:
        return self.sched.request_trackers

    # --- workers -----------------------------------------------------------------------

    def run_worker(self, w: int, n: int | None, script: Any) -> list[dict[str, Any]]:
        """The base loop; then a put that moved wrong bytes fails the op."""
        out = super().run_worker(w, n, script)
        self._raise_byte_errors()
        return out

    def run_one(self, w: int) -> tuple[int, str, str | None] | None:
        ws = self.workers[w]
        if not ws.queue:
            return None
        head = ws.queue[0]
        self.store.context = store_context(head.req_id, head.block_hashes,
                                           self.trace_config.hash_block_size)
        self.current_job = head.store_job_id
        ((job, err),) = ws.run(1)
        return job.store_job_id, job.req_id, err

    def worker_state(self, w: int) -> dict[str, Any]:
        ws = self.workers[w]
        return {"pressure": ws.gate.store_pressure_active,
                "skipped": sorted(ws.gate.skip_store_requests),
                "offsets": {r: n for r, n in sorted(ws.saved_offset.items())},
                "queued": [j.store_job_id for j in ws.queue]}

    def take_completed(self, w: int) -> dict[int, int]:
        meta = self.workers[w].build_connector_worker_meta()
        if meta is None:
            return {}
        for j, off in meta.saved_offsets.items():  # the lowest per job (readable pins)
            self.offsets[j] = min(off, self.offsets.get(j, off))
        return dict(meta.completed_saves)

    def report(self, completed: dict[int, int]) -> list[int]:
        before = set(self.sched.held)
        offsets, self.offsets = self.offsets, {}
        self.sched.update_connector_output(TailproofWorkerMeta(completed_saves=dict(completed),
                                                               saved_offsets=offsets))
        return self._released(before, completed)

    # --- lookups and store -------------------------------------------------------------

    def store_lookup(self, req: Any, n: int) -> tuple[int, list[tuple[int, int]]]:
        res = self.lookup_client.lookup(n, req.block_hashes)
        return res.hit_length, [tuple(t) for t in res.tail_key_boundaries]

    def matched(self, req: Any, num_computed: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(req, num_computed)

    def store_key(self, rank: int, group: int, block_hash: Any) -> str:
        return self.keys.key(rank, group, bytes(block_hash))

    def remove_key(self, key: str) -> int:
        """Drop the key from the observed store (a store event the connector sees); the
        real store may keep its bytes, which it then answers as absent."""
        gone = self.store.tags.pop(key, None) is not None
        self.store.removed += gone
        self.store.retagged += gone
        return int(gone)

    def put_key(self, key: str, tag: Tag, req: Any) -> int:
        """Put the value the key's prefix must hold, sealed as a real put seals it."""
        rank, group, boundary, rid = tag
        value = self.runners[rank].expected_block_bytes(group, req.all_token_ids, boundary, rid)
        self._check_size(group, value)
        slot = torch.empty(slot_nbytes(value.numel()), dtype=torch.uint8)
        slot[HEADER_BYTES:].copy_(value.reshape(-1).cpu())
        self.workers[rank].codec.seal(key, slot)
        if not self.store.inner.put(key, slot).saved:
            return 0
        self.store._retag(key, tag)
        return 1

    def _check_size(self, group: int, value: torch.Tensor) -> None:
        """A seeded value has exactly the size of a real block value of its group."""
        layout: KVLayout | None = self.workers[0].layout
        assert layout is not None
        assert value.numel() == layout.block_nbytes[group], (value.numel(), group)

    def store_tags(self) -> list[tuple[int, int, int, str]]:
        return list(self.store.tags.values())
