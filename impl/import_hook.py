"""Patch a module right after it is first imported, without importing it early.

vLLM loads ``vllm.general_plugins`` in every process, most of which never build a scheduler;
importing vLLM's scheduler there would only cost start-up time. Several tailproof plugins patch
the same module (the trace recorder, the junction hook), so the finder here *chains*: it asks
the finders after it for the spec (one of them may be another patcher) and wraps whatever
loader they return, so every registered patch runs, in registration order, whatever order the
plugins were loaded in.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

Patch = Callable[[Any], None]
_PATCHES: dict[str, list[Patch]] = {}


def patch_on_import(module: str, patch: Patch) -> None:
    """Run ``patch(module_object)`` once the module is imported (now, if it already is).
    A patch must be idempotent: it may run again when a plugin registers twice."""
    mod = sys.modules.get(module)
    if mod is not None:
        patch(mod)
        return
    patches = _PATCHES.setdefault(module, [])
    if patch not in patches:
        patches.append(patch)
    if not any(isinstance(f, _PatchOnImport) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(module))


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps the loader of one module so the registered patches run after it executes."""

    def __init__(self, module: str) -> None:
        self.module = module
        self._inner: Any = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        for finder in list(sys.meta_path):  # the rest of the chain, another patcher included
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for patch in _PATCHES.pop(self.module, []):
            patch(module)
