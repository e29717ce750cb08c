"""``tailproof smoke``: a connector configuration in vLLM's real engine on CPU."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.cli.output import stdout_to_stderr
from tailproof.conformance.harness.errors import DIVERGED, OK, UsageError
from tailproof.conformance.realengine import smoke


def cmd_smoke(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}", "pass e.g. 80")
    with stdout_to_stderr():  # vLLM logs to stdout, in this process and in the engine's
        cfg = smoke.parse_config(args.kv_transfer_config)
        verdict = smoke.run(cfg, max_tokens=args.max_tokens)
    print(json.dumps(verdict, indent=2) if args.json else smoke.render(verdict))
    return OK if verdict["ok"] else DIVERGED


def register_smoke(sub: Any) -> None:
    s = add_command(sub, "smoke", "check a connector configuration in vLLM's real engine on "
                    "CPU: cold, warm, store-hit and after-reset passes of a tiny hybrid model "
                    "must equal an engine without prefix caching (exit 1 names the failing pass)",
                    cmd_smoke)
    s.add_argument("--kv-transfer-config", required=True, metavar="JSON",
                   help="the kv_transfer_config your engine runs (JSON, or @FILE), naming "
                        "TailproofConnector with your store and namespace")
    s.add_argument("--max-tokens", type=int, default=80,
                   help="tokens generated per prompt (80 crosses a 64-token Mamba block)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout (every log line goes to stderr)")
