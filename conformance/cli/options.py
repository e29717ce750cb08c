"""The options and parsers several commands share: the help formatter, a subcommand with
its ``--debug``, the report options (``--json``, ``--junit``), the impl adapter's store
options, and ``--adapters`` (with its older spellings)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.errors import UsageError


class SpelledOption(argparse.Action):
    """Store an option's value and the spelling given (``--adapters`` or an older alias such as
    ``--against``), so that an error names the option as the user typed it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}spelling", option_string)


def spelling(args: argparse.Namespace, dest: str, canonical: str) -> str:
    """The option string ``dest`` was given with (``canonical`` when it was not given)."""
    return getattr(args, f"{dest}spelling", None) or canonical


def parse_adapters(text: str, option: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise UsageError(f"{option}: no adapter named", f"name some of {', '.join(ADAPTERS)}")
    for a in names:
        if a not in ADAPTERS:
            raise UsageError(f"{option}: unknown adapter {a!r}",
                             f"use some of {', '.join(ADAPTERS)}")
    return names


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (a flag's as "off"; an unset value's where the help does
    not already say what unset means); keeps the descriptions' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS \
                or "default" in text or action.nargs == 0 and action.const is None:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        if action.default is None:
            return text if "unset:" in text else f"{text} (default: none)"
        return f"{text} (default: {action.default})"


def add_command(sub: Any, name: str, summary: str, func: Callable[[argparse.Namespace], int],
                aliases: tuple[str, ...] = ()) -> Any:
    """One subcommand; ``aliases``: older names that keep working."""
    p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                       formatter_class=HelpFormatter, aliases=list(aliases))
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the Python traceback of an error (default: off)")
    p.set_defaults(func=func)
    return p


def add_report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON document on stdout (all text goes to stderr); "
                        "schema: conformance/schema/report.schema.json")
    p.add_argument("--junit", default=None, metavar="FILE",
                   help="also write the results as JUnit XML to FILE")


def check_junit(args: argparse.Namespace) -> None:
    if args.junit:
        parent = Path(args.junit).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--junit: directory {parent} does not exist", "create it first")


def add_store_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", choices=["memory", "mooncake"], default=None,
                   help="store behind the impl adapter (unset: memory)")
    p.add_argument("--mooncake-master", metavar="HOST:PORT", default=None,
                   help="an existing mooncake_master (unset: start one on 127.0.0.1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="device of the impl adapter's KV tensors (unset: cuda if available)")
