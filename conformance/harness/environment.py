"""Map an exception that escaped a subcommand to the CLI's one line: cause and fix.

Environment failures (a package missing, a store unreachable, a file unreadable, memory) are
exit 2 with a fix; anything else is a bug in tailproof and gets no fix (exit 3, the line asks
for ``--debug``).
"""

from __future__ import annotations


def _store_error() -> type[BaseException] | None:
    try:
        from tailproof.impl.stores.base import StoreError
    except Exception:  # noqa: BLE001 - the store package may not import (no vLLM)
        return None
    return StoreError


def classify(e: BaseException) -> tuple[str, str | None]:
    """``(cause, fix)``; ``fix`` is None when ``e`` is not the user's or the machine's."""
    text = " ".join(str(e).split())
    if isinstance(e, ModuleNotFoundError):
        return (f"the package {e.name!r} is not installed",
                "./scripts/bootstrap.sh (or pip install it); tailproof doctor shows what is "
                "missing")
    if isinstance(e, ImportError):
        return f"an import failed: {text}", "tailproof doctor names the package and version"
    store_error = _store_error()
    if store_error is not None and isinstance(e, store_error):
        return (f"store: {text}", "check that the Mooncake master answers at --mooncake-master "
                "(or omit it to start one on 127.0.0.1), or use --store memory")
    if isinstance(e, MemoryError):
        return "out of memory", "run fewer or smaller traces (limits: docs/trace-format.md)"
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or text}{where}", "check the path, permissions and free space"
    return f"{type(e).__name__}: {text}", None
