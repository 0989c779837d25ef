"""JSON Schema of the spec language (for editors: ``# yaml-language-server: $schema=…``)."""

from __future__ import annotations

import json

from geomopt.spec.model import VIEW_KINDS, Spec

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
    # likewise `view: auto` for `view: {kind: auto}`, on every geometry that has a view
    for definition in out["$defs"].values():
        view = definition.get("properties", {}).get("view")
        if view is not None:
            view["anyOf"].insert(0, {"type": "string", "enum": list(VIEW_KINDS), "description": "shorthand for {kind: …}"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "geomopt-1.schema.json",
        "title": "geomopt spec, language version 1",
        **out,
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"
