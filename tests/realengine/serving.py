"""Helpers for the real-engine tests of serving paths: in-process ``LLM`` engines with the
connector, token-id prompts, greedy generation, ``vllm serve`` as a subprocess on 127.0.0.1.

Every engine runs vLLM 0.33's real engine on the test-bed platform (``TAILPROOF_TESTBED=1``,
``tailproof.conformance.realengine``). The environment variable is set on import, before vLLM
resolves its platform; :func:`require_testbed` fails loudly if vLLM had already resolved another
platform in this process (run ``tests/realengine`` in its own pytest process then).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TAILPROOF_TESTBED", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("vllm")

#: vLLM's engine arguments for the tiny model (../shared/notes/real_engine_cpu.md).
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
    "enable_prefix_caching": True, "prefix_match_unit": 16,
    "kv_cache_memory_bytes": 64 << 20, "max_model_len": 4096,
}


def require_testbed() -> None:
    """Fail (never skip) when vLLM resolved a platform other than the test bed's."""
    from vllm.platforms import current_platform

    name = type(current_platform).__name__
    if name != "TestBedPlatform":
        pytest.fail(f"vLLM's platform is {name}, not the test bed's: run tests/realengine in "
                    "a pytest process of its own (TAILPROOF_TESTBED=1 before vLLM resolves it)")


def kv_transfer_config(store: dict[str, Any], policy: str = "recompute") -> dict[str, Any]:
    """``--kv-transfer-config`` naming ``TailproofConnector`` with ``store`` settings."""
    return {"kv_connector": "TailproofConnector",
            "kv_connector_module_path": "tailproof.impl.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": dict(store), "kv_load_failure_policy": policy}


def prompt(seed: int, n: int, shared: list[int] | None = None) -> list[int]:
    """``n`` deterministic token ids (vocabulary 64, ids 3..62), after ``shared`` if given."""
    head = list(shared or [])
    return head + [(seed * 131 + j * 17 + (j * j) % 7) % 60 + 3 for j in range(n - len(head))]


@contextmanager
def in_process_llm(model_dir: Path, kt: dict[str, Any] | None, **over: Any) -> Iterator[Any]:
    """An ``LLM`` whose engine core runs in this process (its scheduler, connector and memory
    store are then reachable, :func:`scheduler`)."""
    require_testbed()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM

        llm = LLM(model=str(model_dir), kv_transfer_config=kt, **{**ENGINE_ARGS, **over})
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def scheduler(llm: Any) -> Any:
    """The in-process engine core's ``Scheduler``."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output token ids of ``prompts`` (one ``LLM.generate`` batch)."""
    return generate_counted(llm, prompts, max_tokens)[0]


def generate_counted(llm: Any, prompts: list[list[int]], max_tokens: int
                     ) -> tuple[list[list[int]], int]:
    """Greedy output token ids of ``prompts``, and the prompt tokens vLLM reports as cached
    (``RequestOutput.num_cached_tokens``: device prefix cache plus the connector's hits)."""
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(max_tokens),
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            sum(o.num_cached_tokens or 0 for o in outs))


# ---------------------------------------------------------------------- vllm serve


def free_port() -> int:
    from tailproof.conformance.local_master import free_port as fp

    return fp()


class Server:
    """``vllm serve`` in a subprocess on 127.0.0.1 (stopped by its own PID)."""

    def __init__(self, model_dir: Path, kt: dict[str, Any], log: Path,
                 env: dict[str, str] | None = None, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--kv-transfer-config", json.dumps(kt)]
        for k, v in ENGINE_ARGS.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                args.append(flag)
            else:
                args += [flag, str(v)]
        args += extra or []
        full_env = {**os.environ, "TAILPROOF_TESTBED": "1", "VLLM_SERVER_DEV_MODE": "1",
                    **(env or {})}
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Poll ``/health`` until it answers 200 (fails with the log's tail if it exits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # polling a subprocess's readiness, not synchronising the test
        raise AssertionError(f"vllm serve not ready after {timeout_s}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def post(self, path: str, body: dict[str, Any] | None = None,
             timeout: float = 300.0) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback
            raw = r.read()
        return json.loads(raw) if raw.strip() else {}

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:  # noqa: S310
            return r.read().decode()

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of token-id prompts; the generated token ids, in order."""
        out = self.post("/v1/completions", {
            "model": self.model, "prompt": prompts, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]

    def stop(self) -> None:
        """SIGTERM the server's process group (it was started in its own session), then
        SIGKILL if it has not exited in 30 s."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
