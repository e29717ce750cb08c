"""``tailproof validate``: check traces against the format and limits without running them."""

from __future__ import annotations

import argparse
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.cli.traces import load_all
from tailproof.conformance.harness.errors import OK


def cmd_validate(args: argparse.Namespace) -> int:
    for t in load_all(args.traces):
        print(f"ok {t.source}: {len(t.ops)} ops")
    return OK


def register_validate(sub: Any) -> None:
    v = add_command(sub, "validate", "check traces against the format and limits without "
                    "running them", cmd_validate)
    v.add_argument("traces", nargs="+", metavar="TRACE",
                   help="trace files, or directories standing for their *.json")
