"""The CLI's exit-code contract and the one error type every user-facing failure becomes.

0: everything ran and agreed. 1: a divergence or a failed proof. 2: bad input, or an
environment that cannot run what was asked (missing package, unsupported vLLM, unreadable
file). Exit 2 always comes with one line on stderr naming the cause and the fix.
"""

from __future__ import annotations

OK = 0
DIVERGED = 1
USAGE = 2


class UsageError(Exception):
    """Bad input or an unfit environment: exit 2 with one line, ``cause (fix: ...)``."""

    def __init__(self, cause: str, fix: str | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.fix = fix

    def line(self) -> str:
        text = " ".join(self.cause.split())  # one line, whatever the cause text held
        return f"{text} (fix: {self.fix})" if self.fix else text
