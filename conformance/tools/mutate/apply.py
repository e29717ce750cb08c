"""Apply one source mutant to an imported vLLM function, in memory only.

A mutant names a function by module and qualified name (``BlockPool.free_blocks``) and an exact
source snippet with its replacement. The function's source is read with ``inspect``, the snippet
replaced, the edited source compiled in the module's own globals and the result bound where
the original lived (the class or module attribute, plus any other module that imported the
same function object by name). The installed files are never touched: the edit lives only in
the process that applied it (the runner forks a fresh process per mutant).

A snippet that no longer occurs the expected number of times means vLLM changed under the
mutant: ``StaleMutant``, reported as "stale" rather than silently passing.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import sys
import textwrap
from typing import Any

from tailproof.conformance.tools.mutate.catalog import Mutant


class StaleMutant(Exception):
    """The mutant's target or snippet is not in the installed vLLM as written."""


def _owner_and_attr(module: Any, qualname: str) -> tuple[Any, str]:
    parts = qualname.split(".")
    owner = module
    for p in parts[:-1]:
        if not hasattr(owner, p):
            raise StaleMutant(f"{module.__name__}.{qualname}: no attribute {p!r}")
        owner = getattr(owner, p)
    if parts[-1] not in vars(owner):
        raise StaleMutant(f"{module.__name__}.{qualname}: not defined there")
    return owner, parts[-1]


def _function_of(raw: Any) -> Any:
    """The plain function behind a class-dict entry (staticmethod/classmethod/property)."""
    if isinstance(raw, staticmethod | classmethod):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    return raw


def mutated_source(m: Mutant) -> tuple[Any, str, Any, str]:
    """(owner, attribute name, original raw attribute, edited source) for ``m``; raises
    ``StaleMutant`` when the target or the snippet (with its expected count) is missing."""
    module = importlib.import_module(m.module)
    owner, attr = _owner_and_attr(module, m.qualname)
    raw = vars(owner)[attr]
    func = _function_of(raw)
    try:
        src = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as e:
        raise StaleMutant(f"{m.module}.{m.qualname}: source unavailable ({e})") from e
    found = src.count(m.find)
    if found != m.count:
        raise StaleMutant(f"{m.module}.{m.qualname}: snippet found {found} times, "
                          f"expected {m.count}: {m.find.strip()[:60]!r}")
    return owner, attr, raw, src.replace(m.find, m.replace)


def apply_mutant(m: Mutant) -> None:
    """Rebind ``m``'s target to the mutated function in this process."""
    owner, attr, raw, src = mutated_source(m)
    module = sys.modules[m.module]
    # A factory with a ``__class__`` parameter gives zero-argument ``super()`` in the
    # recompiled method the cell it would have had inside its class body.
    factory_src = ("def __tailproof_mutant_factory__(__class__):\n"
                   + textwrap.indent(src, "    ")
                   + f"\n    return {attr}\n")
    # Annotations stay unevaluated, as names imported only for type checking are absent.
    code = compile(factory_src, f"<mutant {m.id}: {m.module}.{m.qualname}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, vars(module), namespace)  # noqa: S102 - the point of a mutation kit
    cls = owner if inspect.isclass(owner) else None
    new = namespace["__tailproof_mutant_factory__"](cls)
    if isinstance(raw, property) and not isinstance(new, property):
        new = property(new, raw.fset, raw.fdel, raw.__doc__)
    setattr(owner, attr, new)
    if not inspect.isclass(owner):
        # Modules that did ``from m import f`` hold the original object: rebind those too.
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if d is None or mod is owner:
                continue
            for name, value in list(d.items()):
                if value is raw:
                    setattr(mod, name, new)
