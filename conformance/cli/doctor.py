"""``tailproof doctor``: the installed packages and what each enables."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tailproof.conformance.cli.options import add_command
from tailproof.conformance.harness.errors import OK
from tailproof.conformance.tools import doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(doctor.report(), indent=2))
    else:
        print(doctor.render(doctor.collect()[1]))
    return OK


def register_doctor(sub: Any) -> None:
    d = add_command(sub, "doctor", "show the installed vLLM, torch, z3, hypothesis, Mooncake and "
                    "libibverbs, and what each enables", cmd_doctor)
    d.add_argument("--json", action="store_true", help="print one JSON document on stdout")
