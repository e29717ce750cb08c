"""One vLLM release's side of ``tailproof diff``: a child process that replays traces on the
vLLM-backed adapters of the vLLM it imports and sends back what they observe.

It is started with the release's ``PYTHONPATH`` (``scripts/vllm_env.sh``, or a folder the user
names), so each release is imported in a process of its own; its one argument is the
adapters to check (``vllm,vllm-mooncake``). Protocol, one JSON object a line: first the
worker's own ``{"version", "release", "path", "refusals"}``; then, for each request
``{"doc": trace, "adapters": [...]}``, ``{"observations": {adapter: [obs | null]},
"refused": {adapter: why}, "error": {adapter: {"op_index", "error"}}}``. The trace runs as
written for the installed release (its ``config.vllm`` is set to it: what the same ops do
here is the question, whichever release the trace was recorded on). Anything else the
process prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO


def _hello(adapters: list[str]) -> dict[str, Any]:
    """This process's vLLM: its version, its supported release (None: outside the set) and,
    per adapter, why it cannot run here (``vllm_compat.refusal``)."""
    from tailproof.conformance.harness import vllm_compat

    info = vllm_compat.inspect_vllm(adapters)
    refusals = {a: why for a in adapters if (why := vllm_compat.refusal(info, a))}
    return {"version": info.version, "release": vllm_compat.release_of(info.version or ""),
            "path": info.path, "refusals": refusals}


def replay(doc: dict[str, Any], adapters: list[str], release: str | None) -> dict[str, Any]:
    """The observations of ``doc``'s ops on each adapter (fresh state each)."""
    from tailproof.conformance.format.trace import parse_trace
    from tailproof.conformance.harness.adapters import make_driver, refusal

    doc = dict(doc, config=dict(doc["config"], **({"vllm": release} if release else {})))
    trace = parse_trace(doc, doc.get("name", "<diff>"))
    out: dict[str, Any] = {"observations": {}, "refused": {}, "error": {}}
    for name in adapters:
        why = refusal(name, trace.config)
        if why is not None:
            out["refused"][name] = why
            continue
        driver = make_driver(name, trace.config)
        obs: list[Any] = []
        try:
            for op in trace.ops:
                obs.append(driver.apply(op))
        except Exception as e:  # noqa: BLE001 - an op that raises is what the release does
            out["error"][name] = {"op_index": len(obs), "error": f"{type(e).__name__}: {e}"}
        finally:
            driver.close()
        out["observations"][name] = obs
    return out


def serve(lines: TextIO, out: TextIO, adapters: list[str]) -> None:
    hello = _hello(adapters)
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in lines:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            reply = replay(req["doc"], req["adapters"], hello["release"])
        except Exception as e:  # noqa: BLE001 - a trace the release cannot load
            reply = {"failed": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> int:
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's own prints go to stderr
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    serve(sys.stdin, channel, sys.argv[1].split(",") if len(sys.argv) > 1 else
          ["vllm", "vllm-mooncake"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
