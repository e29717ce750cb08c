"""Every op is declared once (``conformance/format/ops.py``) and everything else derives from it:
the shipped JSON Schema is the generated one and accepts the corpus, the observation keys and
the renamed id fields come from the declarations, the docs' op table agrees with them, and
every op has a handler on every adapter or a stated refusal."""

from __future__ import annotations

import inspect
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.format import compare, schema
from tailproof.conformance.format.observations import OBSERVES
from tailproof.conformance.format.ops import ALWAYS_OBSERVED, CORE_OPS, OPS
from tailproof.conformance.harness.adapters import ADAPTERS
from tailproof.conformance.harness.backend import CoreBackend
from tailproof.conformance.harness.corpus import corpus_paths
from tailproof.conformance.harness.driver import CoreDriver

ROOT = Path(__file__).parents[2]
SAMPLES_PER_OP = 25  # distinct op objects per op name validated against the schema


def test_the_shipped_schema_is_the_generated_one() -> None:
    shipped = (ROOT / "conformance" / "schema" / "trace.schema.json").read_text()
    assert shipped == schema.render(), (
        "regenerate: .venv/bin/python -m tailproof.conformance.format.schema "
        "> conformance/schema/trace.schema.json")


def test_the_schema_accepts_the_corpus() -> None:
    """Every case's header and config, and up to SAMPLES_PER_OP distinct objects of each op
    name, validate (the whole corpus takes ~20 s with jsonschema; the loader checks it all)."""
    jsonschema = pytest.importorskip("jsonschema")
    full = schema.trace_schema()
    head = jsonschema.Draft202012Validator(
        {**full, "properties": {**full["properties"], "ops": {"type": "array"}}})
    ops = jsonschema.Draft202012Validator({**full["properties"]["ops"]["items"],
                                           "$defs": full["$defs"]})
    samples: dict[str, dict[str, Any]] = defaultdict(dict)
    for path in corpus_paths():
        doc = json.loads(path.read_text())
        head.validate(doc)
        for op in doc["ops"]:
            bucket = samples[op["op"]]
            if len(bucket) < SAMPLES_PER_OP:
                bucket.setdefault(json.dumps(op, sort_keys=True), op)
    assert set(samples) <= set(OPS) | {"snapshot"}
    for bucket in samples.values():
        for op in bucket.values():
            ops.validate(op)


@pytest.mark.parametrize(("op", "why"), [
    ({"op": "allocate", "rid": "a"}, "'n' is a required property"),
    ({"op": "free", "rid": "a", "n": 3}, "Additional properties"),
    ({"op": "table", "rid": "a", "expect": {"chunk": 1}}, "'chunk' is not one of"),
    ({"op": "nope"}, "'nope' is not one of"),
])
def test_the_schema_refuses_what_the_loader_refuses(op: dict[str, Any], why: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    full = schema.trace_schema()
    v = jsonschema.Draft202012Validator({**full["properties"]["ops"]["items"],
                                         "$defs": full["$defs"]})
    assert any(why in e.message for e in v.iter_errors(op)), [e.message for e in
                                                               v.iter_errors(op)]


def test_observation_keys_and_id_fields_derive_from_the_declarations() -> None:
    assert OBSERVES == {n: o.observes | ALWAYS_OBSERVED for n, o in OPS.items()}
    union = set().union(*(o.ids for o in OPS.values()))
    assert compare._ID_FIELDS == union
    assert compare._PAIR_FIRST == {"refcounts"} and compare._TRIPLE_LAST == {"keys"}


def _doc_rows() -> dict[str, tuple[str, str]]:
    """docs/trace-format.md's core op table: op -> (fields cell, observation cell)."""
    rows = {}
    for line in (ROOT / "docs" / "trace-format.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \|([^|]*)\|[^|]*\|([^|]*)\|$", line)
        if m and m.group(1) in CORE_OPS:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_the_docs_op_table_names_each_core_op_with_its_fields_and_observations() -> None:
    rows = _doc_rows()
    assert set(rows) == set(CORE_OPS)
    for name, (fields, observed) in rows.items():
        # a field is a backticked name outside parentheses (those say defaults and meaning)
        named = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", fields)))
        assert named == set(OPS[name].fields), name
        keys = set(re.findall(r"`(\w+)`", re.sub(r"\[[^\]]*\]|\([^)]*\)", "", observed)))
        assert keys <= OPS[name].observes, (name, keys - OPS[name].observes)


def test_each_connector_op_is_documented() -> None:
    text = (ROOT / "docs" / "connector-ops.md").read_text()
    missing = [n for n, o in OPS.items() if o.connector and not re.search(f"`{n}[ `]", text)]
    assert not missing


def test_every_core_op_has_a_driver_handler_and_every_backend_each_call() -> None:
    """Core ops run on every adapter through one driver (``CoreDriver._op_<name>``) over the
    adapter's core backend, which implements every method of ``CoreBackend``."""
    assert all(callable(getattr(CoreDriver, f"_op_{n}", None)) for n in CORE_OPS)
    calls = {n for n, _ in inspect.getmembers(CoreBackend, inspect.isfunction)
             if not n.startswith("_")}
    pytest.importorskip("vllm")
    for spec in ADAPTERS.values():
        module, _, attr = spec.core.partition(":")
        backend = getattr(__import__(module, fromlist=[attr]), attr)
        missing = sorted(c for c in calls if not callable(getattr(backend, c, None)))
        assert not missing, (spec.name, missing)


def test_every_connector_op_has_a_handler_on_every_adapter_or_a_stated_refusal() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("torch")
    connector_ops = {n for n, o in OPS.items() if o.connector}
    for spec in ADAPTERS.values():
        if spec.connector is None:
            assert spec.refuses_connector_ops, f"{spec.name}: no connector and no reason"
            continue
        module, _, attr = spec.connector.partition(":")
        cls = getattr(__import__(module, fromlist=[attr]), attr)
        runs = set(cls.ops)
        refused = dict(getattr(cls, "refused_ops", {}))
        assert runs | set(refused) == connector_ops, spec.name
        missing = sorted(n for n in runs if not callable(getattr(cls, f"_op_{n}", None)))
        assert not missing, (spec.name, missing)


def test_the_docs_config_table_names_each_config_key_once() -> None:
    """The trace's config keys are declared once (``trace_config.CONFIG_KEYS``); the
    Configuration table of docs/trace-format.md names exactly those."""
    from tailproof.conformance.format.trace_config import CONFIG_KEYS

    text = (ROOT / "docs" / "trace-format.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            named += re.findall(r"`(\w+)`", line.split("|")[1])
    assert sorted(named) == sorted(CONFIG_KEYS)
