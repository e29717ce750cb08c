"""tailproof: replay conformance traces on the reference model, vLLM (0.33 or 0.34) and the
tailproof connector, compare them op by op, and prove the spec.

Exit status: 0 everything ran and agreed; 1 a divergence or a failed proof; 2 bad input or an
environment that cannot run what was asked (one line on stderr naming the cause and the fix).
Findings about vLLM never change the exit status. --debug shows the traceback of an error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from tailproof import __version__
from tailproof.conformance.cli import (
    capture,
    check,
    diff,
    doctor,
    expect,
    history,
    mutate,
    prove,
    replay,
    shrink,
    smoke,
    stats,
    validate,
)
from tailproof.conformance.cli.options import HelpFormatter
from tailproof.conformance.format.trace import TraceError
from tailproof.conformance.harness.adapters import AdapterUnavailable
from tailproof.conformance.harness.environment import classify
from tailproof.conformance.harness.errors import OK, USAGE, UsageError

#: exit status of a failure inside tailproof itself (a bug, never a user error)
INTERNAL = 3


#: one entry per subcommand, in --help order (a new subcommand adds one register_* here)
SUBCOMMANDS: list[Callable[[Any], None]] = [
    check.register_check, replay.register_replay, validate.register_validate,
    expect.register_expect, capture.register_capture, shrink.register_shrink,
    prove.register_prove, mutate.register_mutate, history.register_history,
    diff.register_diff,
    doctor.register_doctor, stats.register_stats, smoke.register_smoke,
]


# --- parser ---------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 through the CLI's contract."""

    def error(self, message: str) -> Any:
        # main prints "tailproof: " before the cause: name only the subcommand here.
        where = self.prog.removeprefix("tailproof").strip()
        raise UsageError(f"{where}: {message}" if where else message, f"see {self.prog} --help")


def build_parser() -> Parser:
    p = Parser(prog="tailproof", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"tailproof {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           parser_class=Parser)
    for register in SUBCOMMANDS:
        register(sub)
    return p


# --- entry ----------------------------------------------------------------------------------


def _error_line(e: BaseException) -> tuple[str, str | None]:
    """Cause and fix of an error that reaches main."""
    if isinstance(e, UsageError):
        return e.cause, e.fix
    if isinstance(e, TraceError):
        return str(e), "correct the trace (docs/trace-format.md)"
    if isinstance(e, AdapterUnavailable):
        return f"adapter not available: {e}", "./scripts/bootstrap.sh"
    return classify(e)


def main(argv: list[str] | None = None) -> int:
    """Console entry (``tailproof``): run one subcommand under the exit-code contract."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print("tailproof: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else OK
    except Exception as e:  # noqa: BLE001 - the contract: one line, never a traceback
        if debug:
            raise
        cause, fix = _error_line(e)
        if fix is None:  # not a user error: a bug in tailproof
            print(f"tailproof: internal error: {cause} (a bug in tailproof; rerun with --debug "
                  "for the traceback and report it)", file=sys.stderr)
            return INTERNAL
        print(f"tailproof: {UsageError(cause, fix).line()}", file=sys.stderr)
        return USAGE


if __name__ == "__main__":
    raise SystemExit(main())
