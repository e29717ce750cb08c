"""The real-engine test bed: vLLM's ``LLM`` on CPU (0.33: Model Runner V1; 0.34: the standalone
CPU Model Runner V2) with the tiny hybrid model, one engine per child process. This module is
the API the real-engine tests (and ``tailproof smoke``) use.

Why a child process: vLLM resolves its platform once per process (``current_platform``) and
many modules bind it at import; a pytest process that already imported vLLM for the simulated
runner has it resolved to "unspecified". Each :class:`Bed` therefore starts a fresh ``spawn``
process that sets ``TAILPROOF_TESTBED=1`` (and the rest of :data:`BED_ENV`) before importing
vLLM, builds the ``LLM`` there and serves commands over a pipe; every wait has a timeout.

Usage::

    spec = EngineSpec(kv_transfer_config=memory_connector("my-ns"))
    with Bed(spec) as bed:
        cold = bed.generate(prompts, max_tokens=80)
        warm = bed.generate(prompts, max_tokens=80)        # vLLM's own prefix cache
        bed.reset_prefix_cache()                           # device only
        store = bed.generate(prompts, max_tokens=80)       # hits from the store
        bed.worker(corrupt_store_values, 3)                # any module-level fn(worker, ...)
        bed.call(my_fn, x=1)                               # any module-level fn(llm, ...)

* :class:`EngineSpec`: the engine arguments the bed varies (prefix caching, executor ``uni`` /
  ``mp``, engine core in its own process, ``kv_transfer_config``, pool size, another installed
  vLLM release for this engine: ``vllm_release``, ...); the fixed ones
  are ``skip_tokenizer_init``, ``enforce_eager``, ``dtype="float32"``, token-id prompts,
  greedy sampling with ``ignore_eos``.
* :class:`Bed`: ``generate`` (returns :class:`Completion` s), ``reset_prefix_cache``, ``call``
  (``fn(llm, ...)`` in the bed process), ``worker`` (``fn(worker, ...)`` on every worker through
  ``LLM.collective_rpc``), ``close``.
* Worker-side helpers to pass to ``Bed.worker``: :func:`registered_kv_caches`,
  :func:`perturb_device_cache`, :func:`connector_counters`, :func:`corrupt_store_values`,
  :func:`hold_store_puts` / :func:`hold_store_reads` (a store call held at a gate: a job or
  load in flight at a known point), :func:`worker_leftovers`; engine-side (``Bed.call``):
  :func:`scheduler_pins`, :func:`drain_store_jobs`, :func:`scheduler_leftovers` (what must be
  back to zero on an idle engine: blocks, load slots, pins, per-request state).
* :func:`memory_connector` / :func:`tailproof_connector`: a ``kv_transfer_config`` naming
  ``TailproofConnector``; :mod:`.oracle` runs and compares the standard passes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Environment of every bed process (and so of the engine core and workers it starts).
BED_ENV = {
    "TAILPROOF_TESTBED": "1",  # activates the test-bed platform and model (plugins.py)
    "HF_HUB_OFFLINE": "1",
    # The tiny model gains nothing from threads; on a loaded 2-core machine OpenMP's spinning
    # made a 64x128 matmul 40x slower with 2 threads than with 1.
    "OMP_NUM_THREADS": "1",
    # collective_rpc with a plain function once the engine core is in another process.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


class BedError(RuntimeError):
    """The bed process failed (its traceback is in the message) or did not answer in time."""


@dataclass(frozen=True)
class EngineSpec:
    """What a test varies about the engine (everything else is fixed, see the module doc)."""

    prefix_caching: bool = True
    block_size: int = 64  # the Mamba block too (align mode makes them equal)
    prefix_match_unit: int = 16  # h: partial hits and stored tails on 16-token boundaries
    kv_cache_memory_bytes: int = 64 << 20
    max_model_len: int = 4096
    executor: str = "uni"  # distributed_executor_backend: "uni" or "mp"
    tensor_parallel_size: int = 1  # > 1: the "mp" executor, one worker process per rank
    core_process: bool = False  # the engine core in its own process (EngineCoreProc)
    kv_transfer_config: dict[str, Any] | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    weights_seed: int = 0
    mamba_first: bool = False  # model.py: reproduces vLLM 0.33's block-copy bug (fixed in 0.34)
    engine_args: dict[str, Any] = field(default_factory=dict)  # any other LLM(...) argument
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the bed process
    # another installed vLLM release for this engine ("0.33"; :func:`release_sys_path`), e.g.
    # two releases sharing one store; None: the release this process runs
    vllm_release: str | None = None

    def llm_kwargs(self, model_dir: str) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM``."""
        kw: dict[str, Any] = {
            "model": model_dir, "skip_tokenizer_init": True, "enforce_eager": True,
            "dtype": "float32", "seed": 0, "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.prefix_caching, "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "distributed_executor_backend": self.executor,
            "disable_log_stats": False,
        }
        if self.tensor_parallel_size > 1:
            kw["tensor_parallel_size"] = self.tensor_parallel_size
        if self.prefix_caching:
            kw["prefix_match_unit"] = self.prefix_match_unit
        if self.kv_transfer_config is not None:
            kw["kv_transfer_config"] = dict(self.kv_transfer_config)
        if self.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_num_seqs is not None:
            kw["max_num_seqs"] = self.max_num_seqs
        kw.update(self.engine_args)
        return kw


def tailproof_connector(extra: dict[str, Any] | None = None, *, role: str = "kv_both",
                        failure_policy: str = "recompute") -> dict[str, Any]:
    """A ``kv_transfer_config`` naming ``TailproofConnector`` (docs/deploy.md)."""
    return {
        "kv_connector": "TailproofConnector",
        "kv_connector_module_path": "tailproof.impl.connector",
        "kv_role": role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": dict(extra or {}),
    }


def memory_connector(namespace: str = "tailproof-testbed", **extra: Any) -> dict[str, Any]:
    """``TailproofConnector`` on its embedded memory store (the engine's own process)."""
    return tailproof_connector({"store": "memory", "namespace": namespace,
                                "capacity_bytes": "256MB", **extra})


@dataclass(frozen=True)
class Completion:
    """One request's greedy output."""

    tokens: tuple[int, ...]
    num_cached_tokens: int  # vLLM's count: device prefix-cache hits plus connector hits
    finish_reason: str | None


# --- the bed process ------------------------------------------------------------------------


def _serve(conn: Any, spec: dict[str, Any], model_dir: str) -> None:
    """Bed process main: build the LLM, then answer (op, payload) requests until "close"."""
    os.environ.update({**BED_ENV, **spec["env"]})
    if spec["tensor_parallel_size"] > 1:
        # vLLM's CPU executor binds each worker's OpenMP threads to a NUMA node of its own
        # (``OMPProcessManager``, ``utils/ompmultiprocessing.py``) and refuses more workers than
        # nodes; the bed's workers run one thread each (BED_ENV) and need no binding.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if not spec["core_process"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM

        llm = LLM(**EngineSpec(**spec).llm_kwargs(model_dir))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            break
        if op == "close":
            break
        try:
            conn.send(("ok", _dispatch(llm, op, payload)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    # Shut the engine down (its core process and workers, if any), answer, and exit without
    # the interpreter's slow teardown.
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    finally:
        conn.send(("ok", None))
        conn.close()
        os._exit(0)


def engine_metrics(llm: Any) -> dict[str, float]:
    """vLLM's own counters and gauges (``LLM.get_metrics``), summed over label sets; for
    ``Bed.call`` (e.g. ``vllm:num_preemptions``, ``vllm:external_prefix_cache_hits``)."""
    from vllm.v1.metrics.reader import Counter, Gauge

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if isinstance(m, (Counter, Gauge)):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def release_switch(llm: Any, name: str) -> Any:
    """A ``release`` switch as the bed's own vLLM answers it (``Bed.call(release_switch, name)``:
    a test's expectation per release, read in the engine's process)."""
    from tailproof.conformance.realengine import release

    return getattr(release, name)()


def _dispatch(llm: Any, op: str, payload: Any) -> Any:
    """One request of the parent, run against the bed's ``LLM``."""
    if op == "generate":
        return _generate(llm, *payload)
    if op == "reset":
        return llm.reset_prefix_cache(**payload)
    if op == "call":
        fn, args, kwargs = payload
        return fn(llm, *args, **kwargs)
    if op == "worker":
        fn, args = payload
        return llm.collective_rpc(fn, args=tuple(args))
    raise ValueError(f"unknown test-bed request {op!r}")


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [Completion(tuple(o.outputs[0].token_ids), int(o.num_cached_tokens or 0),
                       o.outputs[0].finish_reason) for o in outs]


# --- the parent's handle --------------------------------------------------------------------


def _vllm_env(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parents[2] / "scripts" / "vllm_env.sh"
    if not script.exists():
        raise BedError(f"{script} not found: another vLLM release needs a checkout of tailproof")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=30,
                          check=False)


def release_sys_path(release: str) -> list[str]:
    """``sys.path`` for a process on installed vLLM ``release``: its overlay first (what
    ``scripts/vllm_env.sh RELEASE`` prints; nothing for the venv's own release), then this
    process's path without any other release's overlay. BedError (the script's line) when the
    release is not installed."""
    mine = _vllm_env(release)
    if mine.returncode != 0:
        raise BedError(mine.stderr.strip() or f"vLLM {release} is not installed")
    others = set()
    for r in _vllm_env("--supported").stdout.split():
        out = _vllm_env(r)
        if r != release and out.returncode == 0 and out.stdout.strip():
            others.add(os.path.realpath(out.stdout.strip()))
    overlay = mine.stdout.strip()
    return [*([overlay] if overlay else []),
            *(p for p in sys.path if not p or os.path.realpath(p) not in others)]


@contextmanager
def _child_sys_path(release: str | None) -> Iterator[None]:
    """While a ``spawn`` child starts (it takes the parent's ``sys.path``): the path of vLLM
    ``release`` (:func:`release_sys_path`), restored at once; None: unchanged."""
    if release is None:
        yield
        return
    saved = sys.path[:]
    sys.path[:] = release_sys_path(release)
    try:
        yield
    finally:
        sys.path[:] = saved


class Bed:
    """One real engine in its own process; a context manager (``close`` on exit)."""

    def __init__(self, spec: EngineSpec | None = None, *, model_dir: str | Path | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        # deferred: the model imports torch and vLLM (seconds); the bed's parent needs neither
        from tailproof.conformance.realengine.model import write_model_dir

        self.spec = spec or EngineSpec()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tailproof-testbed-")
            model_dir = write_model_dir(self._tmp.name, self.spec.weights_seed,
                                        self.spec.mamba_first)
        self.model_dir = str(model_dir)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, asdict(self.spec), self.model_dir),
                                 name="tailproof-testbed", daemon=False)
        with _child_sys_path(self.spec.vllm_release):
            self._proc.start()
        child.close()
        try:
            self._wait("start", start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, what: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise BedError(f"the test-bed engine did not answer {what!r} within {timeout:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise BedError(f"the test-bed engine died during {what!r} "
                           f"(exit code {self._proc.exitcode})") from None
        if status == "error":
            raise BedError(f"{what} failed in the test-bed engine:\n{value}")
        return value

    def _request(self, op: str, payload: Any, timeout: float) -> Any:
        if not self._proc.is_alive():
            raise BedError(f"the test-bed engine is not running (exit code {self._proc.exitcode})")
        self._conn.send((op, payload))
        return self._wait(op, timeout)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32,
                 timeout: float = CALL_TIMEOUT_S) -> list[Completion]:
        """Greedy completions of token-id ``prompts``, in order, as one ``LLM.generate`` batch."""
        return self._request("generate", ([list(p) for p in prompts], max_tokens), timeout)

    def reset_prefix_cache(self, reset_connector: bool = False,
                           reset_running_requests: bool = False) -> bool:
        """``LLM.reset_prefix_cache``: by default the device cache only (the store keeps its
        entries); ``reset_connector`` also moves the connector to a fresh key epoch."""
        return self._request("reset", {"reset_connector": reset_connector,
                                       "reset_running_requests": reset_running_requests},
                             CALL_TIMEOUT_S)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(llm, *args, **kwargs)`` in the bed process (``fn`` importable by name)."""
        return self._request("call", (fn, args, kwargs), CALL_TIMEOUT_S)

    def worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every worker (``LLM.collective_rpc``); one result each."""
        return self._request("worker", (fn, args), CALL_TIMEOUT_S)

    def close(self, timeout: float = 60.0) -> None:
        """Shut the engine down and end the bed process (killed after ``timeout``)."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close", None))
                self._conn.poll(timeout)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)
        self._conn.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- worker-side helpers (run in the worker through Bed.worker) ------------------------------


def _layer_caches(worker: Any) -> dict[str, Any]:
    """Each KV cache layer's bound cache (attention: the 4D view; Mamba: (conv, ssm) views)."""
    runner = worker.model_runner
    names = [n for g in runner.kv_cache_config.kv_cache_groups for n in g.layer_names]
    ctx = runner.compilation_config.static_forward_context
    return {n: ctx[n].kv_cache for n in sorted(names)}


def registered_kv_caches(worker: Any) -> dict[str, dict[str, Any]]:
    """What the runner handed ``register_kv_caches``, per layer: shape, strides, dtype, byte
    offset into the shared buffer; plus each layer's bound views (``views``). The runner's
    per-layer tensors come from ``release.runner_kv_caches_by_layer`` (V1 and V2 keep them
    differently)."""
    from tailproof.conformance.realengine.release import runner_kv_caches_by_layer

    bound = _layer_caches(worker)
    out: dict[str, dict[str, Any]] = {}
    for name, t in sorted(runner_kv_caches_by_layer(worker.model_runner).items()):
        views = bound[name] if isinstance(bound[name], (tuple, list)) else [bound[name]]
        out[name] = {
            "shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
            "byte_offset": t.storage_offset() * t.element_size(),
            "views": [{"shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype)}
                      for v in views],
        }
    return out


def perturb_device_cache(worker: Any, layer: str, part: int = 0) -> int:
    """Flip the sign bit of the largest-magnitude value in every block of one layer's device
    cache (attention: its K/V view; Mamba: state ``part``, 0 conv, 1 SSM): a one-bit error per
    block. Prefix-cache entries keep pointing at the blocks, so a later hit reads it. Returns
    the number of blocks changed."""
    import torch

    cache = _layer_caches(worker)[layer]
    t = cache[part] if isinstance(cache, (tuple, list)) else cache
    flat = t.abs().reshape(t.shape[0], -1)  # a copy where the view is strided: read only
    idx = torch.unravel_index(flat.argmax(dim=1), tuple(t.shape[1:]))
    blocks = torch.arange(t.shape[0])
    t[(blocks, *idx)] = -t[(blocks, *idx)]
    return int((flat.amax(dim=1) > 0).sum())


def zero_device_cache(worker: Any) -> int:
    """Zero every KV cache tensor the runner holds (attention K/V and Mamba states)."""
    for t in worker.model_runner.kv_caches:
        t.zero_()
    return len(worker.model_runner.kv_caches)


def connector_counters(worker: Any) -> dict[str, int]:
    """The worker connector's counters since start (puts, gets, verify failures, ...)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    return side.metrics.c.totals()


def _value_size(store: Any, key: str) -> int | None:
    """A stored value's size: the memory store's API, or the Mooncake client's ``get_size``
    (the connector's ``MooncakeStore`` has no size query; the test bed reads its client)."""
    if hasattr(store, "value_size"):
        return store.value_size(key)
    size = int(store._client.get_size(key))
    return size if size >= 0 else None


def corrupt_store_values(worker: Any, count: int | None = None,
                         keys: list[str] | None = None, rank: int | None = None) -> int:
    """Flip one payload byte in ``count`` stored values (all when None), through the store's
    API (read, remove, put back changed); returns how many were corrupted. ``keys``: these
    values (default: every key of the memory store); ``rank``: only on that tensor-parallel
    rank's worker (the others do nothing and return 0)."""
    import numpy as np
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if rank is not None and tp_rank(worker) != rank:
        return 0
    store = get_kv_transfer_group().store
    keys = list(store.keys() if keys is None else keys)
    if count is not None:
        keys = keys[:count]
    done = 0
    for key in keys:
        size = _value_size(store, key)
        if size is None:
            continue
        buf = np.empty(size, np.uint8)
        if not store.get(key, buf).ok:
            continue
        buf[size // 2] ^= 0xFF
        store.remove([key])
        if store.put(key, buf).ok:
            done += 1
    return done


#: per worker process: the keys its store reads since :func:`record_store_reads`
_READS: dict[str, list[str]] = {}


def record_store_reads(worker: Any) -> bool:
    """Record the keys of every store read of the worker's connector (loads) until
    :func:`recorded_store_reads`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group().worker_side.store
    read = _READS.setdefault("keys", [])
    read.clear()
    plain = type(store).read_batch

    def recording(keys: Any, *args: Any, **kwargs: Any) -> Any:
        read.extend(keys)
        return plain(store, keys, *args, **kwargs)

    store.read_batch = recording  # an instance attribute shadows the method
    return True


def recorded_store_reads(worker: Any) -> list[str]:
    """Stop :func:`record_store_reads`; the keys read meanwhile, in order."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group().worker_side.store
    if "read_batch" in vars(store):
        del store.read_batch
    return list(_READS.pop("keys", []))


def remove_store_values(worker: Any, keys: list[str], rank: int = 0) -> int:
    """Remove ``keys`` from the store, on tensor-parallel rank ``rank``'s worker only (the
    store is shared); returns how many were removed (0 on the other ranks)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if tp_rank(worker) != rank:
        return 0
    return get_kv_transfer_group().store.remove(keys)


def wait_connector_idle(worker: Any, timeout: float, rank: int | None = None) -> bool:
    """Wait up to ``timeout`` until the worker's connector runs no load or store job (its
    results then wait for the next step to collect them); whether it got there. ``rank``: only
    on that tensor-parallel rank's worker (the others answer True at once, e.g. one whose store
    calls :func:`hold_store_puts` holds)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if rank is not None and tp_rank(worker) != rank:
        return True
    return get_kv_transfer_group().worker_side.wait_idle(timeout)


def tp_rank(worker: Any) -> int:
    """This worker's tensor-parallel rank."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


#: per worker process: the gate that :func:`hold_store_puts` put in front of its store puts
_PUT_GATE: dict[str, Any] = {}


def hold_store_puts(worker: Any, rank: int) -> bool:
    """On tensor-parallel rank ``rank``'s worker: every store put of the connector waits until
    :func:`release_store_puts` (the other ranks' puts run). A save job on that rank then stays
    unfinished, so the scheduler's pins of its blocks must stay. Returns whether this worker
    is the one held."""
    import threading

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if tp_rank(worker) != rank:
        return False
    store = get_kv_transfer_group().store
    gate = _PUT_GATE.setdefault("event", threading.Event())
    gate.clear()
    for name in ("put_batch", "write_batch"):
        original = getattr(type(store), name)

        def held(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            gate.wait()
            return _original(store, *args, **kwargs)

        setattr(store, name, held)
    return True


def release_store_puts(worker: Any) -> bool:
    """Open :func:`hold_store_puts`'s gate (no-op on a worker that holds none)."""
    gate = _PUT_GATE.get("event")
    if gate is None:
        return False
    gate.set()
    return True


class _ReadGate:
    """A gate in front of one store's ``read_batch`` that counts the reads waiting at it."""

    def __init__(self, store: Any) -> None:
        import threading

        self.store = store
        self.open = threading.Event()
        self.cond = threading.Condition()
        self.waiting = 0  # reads inside read_batch, held at the gate now
        self.passed = 0  # reads let through since the gate was put up
        original = type(store).read_batch

        def held(*args: Any, **kwargs: Any) -> Any:
            with self.cond:
                self.waiting += 1
                self.cond.notify_all()
            self.open.wait()
            with self.cond:
                self.waiting -= 1
                self.passed += 1
            return original(store, *args, **kwargs)

        store.read_batch = held  # an instance attribute shadows the method until release


#: per worker process: the gate :func:`hold_store_reads` put in front of its store's reads
_READ_GATE: dict[str, _ReadGate] = {}


def hold_store_reads(worker: Any) -> bool:
    """Every store read of the worker's connector (a load's one ``read_batch``) waits at a gate
    until :func:`release_store_reads`: a load that started stays in flight, inside its read,
    for as long as a test needs (its staging buffer taken, its request in vLLM's
    ``WAITING_FOR_REMOTE_KVS``). Returns True."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if "gate" in _READ_GATE:
        raise RuntimeError("store reads are already held")
    _READ_GATE["gate"] = _ReadGate(get_kv_transfer_group().worker_side.store)
    return True


def reads_held(worker: Any, count: int = 1, timeout: float = CALL_TIMEOUT_S) -> int:
    """How many reads wait at :func:`hold_store_reads`'s gate, once at least ``count`` do
    (waiting on the gate's condition for up to ``timeout``, never polling)."""
    gate = _READ_GATE["gate"]
    with gate.cond:
        gate.cond.wait_for(lambda: gate.waiting >= count, timeout)
        return gate.waiting


def release_store_reads(worker: Any) -> int:
    """Open :func:`hold_store_reads`'s gate and take it down; returns how many reads had
    reached it (0 on a worker that holds none)."""
    gate = _READ_GATE.pop("gate", None)
    if gate is None:
        return 0
    del gate.store.read_batch  # later reads go straight to the store
    gate.open.set()
    with gate.cond:
        return gate.passed + gate.waiting


# --- engine-side helpers (run in the bed process through Bed.call) ---------------------------


def scheduler_connector(llm: Any) -> Any:
    """The scheduler role's ``TailproofConnector`` (engine core in the bed process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def scheduler_pins(llm: Any) -> dict[str, Any]:
    """The scheduler role's pins: blocks pinned, and per held store job how many workers have
    yet to report it finished; plus the connector's key epoch."""
    side = scheduler_connector(llm).scheduler_side
    return {"pinned_blocks": side.metrics.pinned_blocks,
            "held": {job: left for job, (_, left) in side.held.items()},
            "epoch": side.epoch, "loads_failed": side.metrics.c.totals().get("loads_failed", 0)}


def scheduler_leftovers(llm: Any) -> dict[str, int]:
    """What the scheduler process still holds for requests, vLLM's and the connector's
    scheduler role's: every value is 0 on an idle engine (no request left, every store job
    and load reported), whatever was aborted or preempted on the way. A value left above 0
    is a leak: blocks or a load slot vLLM never gets back, pins, per-request state."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    side = sched.connector.scheduler_side
    memos = getattr(side.lookup_client, "memos", {})
    return {
        "vllm_requests": len(sched.requests),
        "vllm_blocks_in_use": pool.num_gpu_blocks - pool.get_num_free_blocks() - 1,  # null
        # vLLM 0.34 (Scheduler.finish_requests): an aborted request whose load is in flight
        # keeps a --max-num-inflight-kv-loads slot until the connector reports the load
        "vllm_aborted_kv_loads": len(getattr(sched, "_aborted_kv_loads", ())),
        # requests in an asynchronous load's stages (waiting to start, in progress, done and
        # waiting for a running slot: ``Scheduler._set_kv_fetch_stage``)
        "vllm_kv_fetch_stages": sum((getattr(sched, "_kv_fetch_counts", None) or {}).values()),
        "vllm_finished_recving": len(sched.finished_recving_kv_req_ids),
        "pinned_blocks": side.metrics.pinned_blocks,
        "held_store_jobs": len(side.held),
        "load_specs": len(side.load_specs),
        "request_trackers": len(side.request_trackers),
        "unfinished_requests": len(side.unfinished_requests),
        "remembered_lookups": len(memos),
        "finished_tail_jobs": len(side.finished_partial_tails) + side.ext.pending_jobs(),
        "snapshot_slots": len(side.ext.snapshot_slots()),
    }


def worker_leftovers(worker: Any) -> dict[str, int]:
    """What a worker's connector still holds: every value is 0 on an idle engine (see
    :func:`scheduler_leftovers`). ``staging_in_use``: host staging buffers taken (a store
    handle a load or save holds while it runs); ``store_leases``: memory-store values a read
    is copying out of (the memory store's read lease)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    leases = getattr(side.store, "_leases", None)  # the memory store's; Mooncake's are the master's
    return {
        "loads_queued": side.receivers.pending if side.receivers is not None else 0,
        "store_jobs_queued": side.senders.pending if side.senders is not None else 0,
        "staging_in_use": side.pool.in_use if side.pool is not None else 0,
        "store_leases": len(leases) if leases is not None else 0,
        "load_results_untaken": len(side.finished_recving) + len(side.failed_recving),
        "load_outcomes": len(side.load_ok),
        "stored_requests": len(side.stored_requests),
        "saved_offsets": len(side.saved_offset),
        "store_job_reports_untaken": len(side.completed_saves),
    }


def drain_store_jobs(llm: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` on every worker for its store jobs and take their reports now
    (``TailproofConnector.drain_for_reset``); whether no pin is left."""
    return scheduler_connector(llm).drain_for_reset(llm.collective_rpc, timeout)
