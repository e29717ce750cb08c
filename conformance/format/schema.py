"""The JSON Schema of trace format 1, generated from the declarations it describes: the ops
(``ops.OPS``: fields, kinds, observation keys) and the trace's config section. The shipped file
``conformance/schema/trace.schema.json`` is this module's output (a test keeps the two equal, and
checks that every case of the corpus validates against it)::

    .venv/bin/python -m tailproof.conformance.format.schema > conformance/schema/trace.schema.json

The loader (``trace.py``) is what tailproof itself validates with; the schema is for other
tools, and checks less (request ids are not tracked, ``ANY`` fields are free JSON).
"""

from __future__ import annotations

import json
from typing import Any

from tailproof.conformance.format.ops import (
    ALWAYS_OBSERVED,
    KIND_SCHEMAS,
    OPS,
    RENAMED_OPS,
    REQUIRED,
)

# The trace's own fields besides ``config`` and ``ops``.
HEADER: dict[str, Any] = {
    "format": {
        "const": "tailproof-trace/1"
    },
    "name": {
        "type": "string"
    },
    "description": {
        "type": "string"
    },
    "notes": {},
    "provenance": {
        "type": "object",
        "description": (
            "where a captured trace came from: vllm (version), recorder, tailproof, connector, "
            "redacted, segment/continues for rotated captures"
        )
    }
}

# A compact token list (``tokens.expand``).
TOKENS: dict[str, Any] = {
    "type": "array",
    "items": {
        "oneOf": [
            {
                "type": "integer",
                "minimum": 0
            },
            {
                "type": "object",
                "properties": {
                    "fill": {
                        "type": "integer",
                        "minimum": 0
                    },
                    "n": {
                        "type": "integer",
                        "minimum": 0
                    }
                },
                "required": [
                    "fill",
                    "n"
                ],
                "additionalProperties": False
            },
            {
                "type": "object",
                "properties": {
                    "range": {
                        "type": "array",
                        "items": {
                            "type": "integer",
                            "minimum": 0
                        },
                        "minItems": 2,
                        "maxItems": 2
                    }
                },
                "required": [
                    "range"
                ],
                "additionalProperties": False
            },
            {
                "type": "object",
                "properties": {
                    "prompt_of": {
                        "type": "string"
                    },
                    "n": {
                        "type": "integer",
                        "minimum": 0
                    }
                },
                "required": [
                    "prompt_of",
                    "n"
                ],
                "additionalProperties": False
            }
        ]
    }
}

# The ``config`` section (``trace._parse_config``).
CONFIG: dict[str, Any] = {
    "type": "object",
    "required": [
        "groups",
        "hash_block_size",
        "num_blocks"
    ],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": [
                    "kind",
                    "block_size"
                ],
                "additionalProperties": False,
                "properties": {
                    "kind": {
                        "enum": [
                            "full_attention",
                            "sliding_window",
                            "mamba_align"
                        ]
                    },
                    "block_size": {
                        "type": "integer",
                        "minimum": 1
                    },
                    "eagle": {
                        "type": "boolean"
                    },
                    "mamba_cache_mode": {
                        "const": "align"
                    },
                    "sliding_window": {
                        "type": "integer",
                        "minimum": 1,
                        "description": (
                            "window in tokens; required for (and only for) a sliding_window group"
                        )
                    },
                    "num_speculative_blocks": {
                        "type": "integer",
                        "minimum": 0,
                        "description": (
                            "MambaSpec.num_speculative_blocks (Mamba groups only; > 0 not with a "
                            "connector)"
                        )
                    }
                }
            }
        },
        "hash_block_size": {
            "type": "integer",
            "minimum": 1,
            "description": "h; must divide every group's block_size"
        },
        "num_blocks": {
            "type": "integer",
            "minimum": 2
        },
        "enable_caching": {
            "type": "boolean"
        },
        "use_eagle": {
            "type": "boolean"
        },
        "enable_mamba_shared_prefix_checkpoint": {
            "type": "boolean",
            "description": (
                "CacheConfig.enable_mamba_shared_prefix_checkpoint; takes effect with an EAGLE "
                "group and partial hits"
            )
        },
        "max_model_len": {
            "type": "integer",
            "minimum": 0
        },
        "max_num_scheduled_tokens": {
            "type": "integer",
            "minimum": 0
        },
        "long_prefill_token_threshold": {
            "type": "integer",
            "minimum": 0
        },
        "connector": {
            "type": "object"
        },
        "split_block_size": {
            "type": "integer",
            "minimum": 1,
            "description": "cache_config.block_size of the scheduler split; a group block size"
        },
        "prefix_cache_retention_interval": {
            "type": [
                "integer",
                "null"
            ],
            "minimum": 0,
            "description": (
                "KVCacheConfig.prefix_cache_retention_interval; null/absent = dense Mamba and "
                "sliding-window retention; 0 or an interval (sparse) makes every adapter "
                "refuse the trace"
            )
        },
        "vllm": {
            "enum": [
                "0.33",
                "0.34"
            ],
            "description": (
                "the vLLM release whose semantics the trace expects (docs/releases.md); absent = "
                "0.33"
            )
        },
        "num_hash_lookahead_tokens": {
            "const": 0,
            "description": (
                "VllmConfig.num_hash_lookahead_tokens as the engine resolved it; hash lookahead is "
                "not modelled, so only 0 (the default) is accepted"
            )
        }
    }
}


def op_schema(name: str) -> dict[str, Any]:
    """One op object: its fields by kind (required where the declaration has no default), an
    ``expect`` of its observation keys, a ``comment``."""
    op = OPS[name]
    props: dict[str, Any] = {"op": {}, "comment": {"type": "string"},
                             "expect": {"type": "object", "propertyNames": {
                                 "enum": sorted(op.observes | ALWAYS_OBSERVED)}}}
    props.update({f: KIND_SCHEMAS[spec.kind] for f, spec in op.fields.items()})
    required = ["op", *(f for f, spec in op.fields.items() if spec.default is REQUIRED)]
    return {"description": op.calls, "properties": props, "required": required,
            "additionalProperties": False}


def trace_schema() -> dict[str, Any]:
    """The whole schema: the header, the config section, and the ops (each object is checked
    against the schema of the op it names; old op names read as their new ones)."""
    names = {**{n: n for n in OPS}, **RENAMED_OPS}
    ops = {"type": "object", "required": ["op"],
           "properties": {"op": {"enum": list(names)}},
           "allOf": [{"if": {"properties": {"op": {"const": alias}}}, "then": op_schema(name)}
                     for alias, name in names.items()]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "tailproof-trace/1",
        "title": "tailproof trace, format 1 (generated by conformance/format/schema.py from the "
                 "op and config declarations: do not edit)",
        "type": "object",
        "required": ["format", "config", "ops"],
        "additionalProperties": False,
        "properties": {**HEADER, "config": CONFIG, "ops": {"type": "array", "items": ops}},
        "$defs": {"tokens": TOKENS},
    }


def render() -> str:
    """The shipped file's text."""
    return json.dumps(trace_schema(), indent=1) + "\n"


if __name__ == "__main__":
    print(render(), end="")
