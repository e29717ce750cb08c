"""``vllm serve`` on the test bed as a subprocess on 127.0.0.1 (``TAILPROOF_TESTBED=1`` and
the rest of the bed's environment, ``conformance.realengine.bed.BED_ENV``), driven over HTTP
with token-id prompts; engines inside the pytest process are ``Bed`` s, never ``LLM`` s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

#: ``vllm serve`` arguments: the bed's fixed engine arguments (``EngineSpec`` defaults).
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "seed": 0,
    "enable_prefix_caching": True, "prefix_match_unit": 16, "block_size": 64,
    "kv_cache_memory_bytes": 64 << 20, "max_model_len": 4096,
}


def kv_transfer_config(store: dict[str, Any], policy: str = "recompute") -> dict[str, Any]:
    """``--kv-transfer-config`` naming ``TailproofConnector`` with ``store`` settings."""
    return {"kv_connector": "TailproofConnector",
            "kv_connector_module_path": "tailproof.impl.connector", "kv_role": "kv_both",
            "kv_connector_extra_config": dict(store), "kv_load_failure_policy": policy}


# ---------------------------------------------------------------------- vllm serve


def free_port() -> int:
    from tailproof.conformance.harness.local_master import free_port as fp

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
        from tailproof.conformance.realengine.bed import BED_ENV

        full_env = {**os.environ, **BED_ENV, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
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
