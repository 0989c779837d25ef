"""JSON Schema of the spec language (for editors: ``# yaml-language-server: $schema=…``)."""

from __future__ import annotations

import json

from geomopt.spec.model import Spec

SCHEMA_PATH = "schema/geomopt-1.schema.json"  # committed copy, kept equal to schema_text() by a test


def schema() -> dict:
    out = Spec.model_json_schema()
    # `match: "pattern"` is shorthand for `match: {name: "pattern"}` (a before-validator that
    # pydantic's schema cannot see): without this every shipped spec would fail editor validation
    out["$defs"]["Rule"]["properties"]["match"] = {
        "anyOf": [
            {"type": "string", "minLength": 1, "description": "shorthand for {name: pattern}"},
            {"$ref": "#/$defs/Match"},
        ],
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "geomopt-1.schema.json",
        "title": "geomopt spec, language version 1",
        **out,
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"
