"""``tailproof stats``: a running engine's connector metrics."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.harness.errors import OK, UsageError
from tailproof.conformance.tools import stats


def cmd_stats(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}", "pass seconds, e.g. 5")
    url, s = stats.read_stats(args.url, args.timeout)
    print(json.dumps(s, indent=2) if args.json else stats.render(s, url))
    return OK


def register_stats(sub: Any) -> None:
    s = add_command(sub, "stats", "read a running engine's /metrics and print the connector's "
                    "lookups, hit split, puts/gets, failures and pinned blocks", cmd_stats)
    s.add_argument("url", metavar="URL",
                   help="the engine's address or metrics URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--timeout", type=float, default=5.0,
                   help="seconds for the whole read: connect, headers and body (the response "
                        "is also capped at 16 MiB)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")
