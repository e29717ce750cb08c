"""Trace format v1: load a JSON trace, validate it completely, and normalise its ops.

Nothing runs until the whole trace is valid. Every problem is one ``TraceError`` line naming
where it is (``config.hash_block_size``, ``ops[3].rid``) and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailproof.conformance.format import limits
from tailproof.conformance.format import ops as opspec
from tailproof.conformance.format.tokens import TokenError, expand
from tailproof.conformance.format.trace_checks import CheckError, check_config, check_ops
from tailproof.conformance.format.trace_config import GROUP_KINDS as GROUP_KINDS
from tailproof.conformance.format.trace_config import GroupConfig as GroupConfig
from tailproof.conformance.format.trace_config import TraceConfig as TraceConfig
from tailproof.conformance.format.trace_config import TraceError as TraceError
from tailproof.conformance.format.trace_config import parse_config
from tailproof.conformance.format.trace_file import ReadRefused, read_trace_bytes

FORMAT_TAG = "tailproof-trace/1"


@dataclass
class Trace:
    name: str
    description: str
    config: TraceConfig
    ops: list[dict[str, Any]]
    source: str = "<trace>"
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def expectations(self) -> list[dict[str, Any] | None]:
        return [op.get("expect") for op in self.ops]


def _err(source: str, where: str, msg: str) -> TraceError:
    return TraceError(f"{source}: {where}: {msg}")


class OpReader:
    """Validates and normalises a trace's ops one at a time, in order, tracking the requests
    they name; the loader reads a whole trace with it, a lockstep run one op as it is written."""

    def __init__(self, source: str = "<trace>") -> None:
        self.source = source
        self.specs = opspec.all_op_specs()
        self.prompts: dict[str, list[int]] = {}  # expanded prompt of every request added
        self.live: set[str] = set()
        self.known: set[str] = set()

    def read(self, i: int, op: Any) -> dict[str, Any]:
        """The normalised op ``ops[i]`` (every field present, tokens expanded)."""
        source, where = self.source, f"ops[{i}]"
        if not isinstance(op, dict):
            raise _err(source, where, "must be an object")
        name = op.get("op")
        name = opspec.RENAMED_OPS.get(name, name) if isinstance(name, str) else name
        if not isinstance(name, str) or name not in self.specs:
            raise _err(source, f"{where}.op", f"unknown op {name!r}")
        spec = self.specs[name]
        extra = sorted(set(op) - set(spec) - {"op", "expect", "comment"})
        if extra:
            raise _err(source, f"{where}.{extra[0]}", f"unknown field for op {name!r}")
        norm: dict[str, Any] = {"op": name}
        for fname, f in spec.items():
            if fname not in op:
                if f.default is opspec.REQUIRED:
                    raise _err(source, f"{where}.{fname}", f"required by op {name!r}")
                norm[fname] = f.default
                continue
            norm[fname] = self._field(f"{where}.{fname}", f.kind, op[fname])
        self._track(where, norm)
        for key in ("expect", "comment"):
            if key in op:
                if key == "expect" and not isinstance(op[key], dict):
                    raise _err(source, f"{where}.expect", "must be an object")
                norm[key] = op[key]
        return norm

    def _field(self, where: str, kind: str, v: Any) -> Any:
        problem = opspec.field_problem(kind, v)
        if problem:
            raise _err(self.source, where, problem)
        if kind == opspec.RID and v not in self.known:
            raise _err(self.source, where, f"unknown request id {v!r}")
        if kind == opspec.TOKENS:
            try:
                return expand(v, self.prompts)
            except TokenError as e:
                raise _err(self.source, where, str(e)) from None
        return v

    def _track(self, where: str, norm: dict[str, Any]) -> None:
        name = norm["op"]
        if name == "add_request":
            rid = norm["rid"]
            if rid in self.live:
                raise _err(self.source, f"{where}.rid",
                           f"request {rid!r} is still live (free it first)")
            if not norm["tokens"]:
                raise _err(self.source, f"{where}.tokens", "a prompt needs at least one token")
            self.prompts[rid] = norm["tokens"]
            self.live.add(rid)
            self.known.add(rid)
        elif name == "free":
            self.live.discard(norm["rid"])
        if name == "evict" and (norm["blocks"] is None) == (norm["keys"] is None):
            raise _err(self.source, f"{where}.blocks", "evict takes exactly one of blocks or keys")


def parse_trace(doc: Any, source: str = "<trace>", protocol: bool = False) -> Trace:
    """Validate a decoded trace document and return it with normalised ops; ``protocol``
    adds the step protocol (docs/trace-format.md, "Step protocol"), which every trace the
    CLI reads (``load_trace``) and every trace ``shrink`` emits must pass."""
    if not isinstance(doc, dict):
        raise _err(source, "trace", "must be a JSON object")
    if doc.get("format") != FORMAT_TAG:
        raise _err(source, "format", f"expected {FORMAT_TAG!r}, got {doc.get('format')!r}")
    extra = sorted(set(doc) - {"format", "name", "description", "config", "ops", "notes",
                                "provenance"})
    if extra:
        raise _err(source, extra[0], "unknown top-level key")
    config = parse_config(doc.get("config"), source)
    try:
        check_config(config)
    except CheckError as e:
        raise TraceError(f"{source}: {e}") from None
    ops_doc = doc.get("ops")
    if not isinstance(ops_doc, list):
        raise _err(source, "ops", "must be a list")
    reader = OpReader(source)
    out = [reader.read(i, op) for i, op in enumerate(ops_doc)]
    try:
        check_ops(out, config, protocol)
    except CheckError as e:
        raise TraceError(f"{source}: {e}") from None
    name = doc.get("name") or Path(source).stem
    return Trace(str(name), str(doc.get("description", "")), config, out, source, doc)


def load_trace(path: str | Path) -> Trace:
    """Read and validate one trace file."""
    p = Path(path)
    try:
        text = read_trace_bytes(p).decode("utf-8")
    except ReadRefused as e:
        raise TraceError(f"{p}: {e}") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text (byte {e.start}): a trace is a JSON file") \
            from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise TraceError(f"{p}: invalid JSON at {where}: {e.msg}") from None
    except RecursionError:
        raise TraceError(f"{p}: nested deeper than {limits.MAX_DEPTH} levels (the limit)") \
            from None
    except ValueError as e:  # an int literal longer than Python's digit limit
        raise TraceError(f"{p}: invalid JSON: {str(e).split(';')[0]}") from None
    problem = limits.depth_problem(doc)
    if problem:
        raise TraceError(f"{p}: {problem} (the limit)")
    return parse_trace(doc, str(p), protocol=True)
