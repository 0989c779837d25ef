"""JSON Schema of the spec language (for editors: ``# yaml-language-server: $schema=…``)."""

from __future__ import annotations

import json

from geomopt.spec.geometries import VIEW_KINDS
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
    # likewise `view: auto` for `view: {kind: auto}`, on every geometry that has a view
    for definition in out["$defs"].values():
        view = definition.get("properties", {}).get("view")
        if view is not None:
            view["anyOf"].insert(0, {"type": "string", "enum": list(VIEW_KINDS),
                                     "description": "shorthand for {kind: …}"})
    _inheritance(out)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "geomopt-1.schema.json",
        "title": "geomopt spec, language version 1",
        **out,
    }


def _inheritance(out: dict) -> None:
    """A spec with ``extends`` (:mod:`geomopt.spec.extends`) may leave ``rules`` out, and its
    rules are overrides: only ``name`` is required, ``before``/``after``/``remove`` are allowed,
    and a ``{kind: …}`` value (geometry, constraint, direction, …) may give only the fields it
    changes (it merges into the base's value of the same kind)."""
    fields = out["$defs"]["Rule"]["properties"]

    def override(name: str, prop: dict) -> dict:
        union = next((s for s in [prop, *prop.get("anyOf", [])] if "discriminator" in s), None)
        if union is None:
            return {"$ref": f"#/$defs/Rule/properties/{name}"}
        partial = {"type": "object", "required": ["kind"],
                   "properties": {"kind": {"enum": sorted(union["discriminator"]["mapping"])}}}
        return {"anyOf": [partial, {"type": "null"}]} if "anyOf" in prop else partial
    out["$defs"]["RuleOverride"] = {
        "type": "object",
        "title": "RuleOverride",
        "description": "In a spec with `extends`: a rule named as a base rule overrides it field by field, in its "
                       "place; a new rule is added at the end, or before/after a base rule.",
        "properties": {
            **{k: override(k, v) for k, v in fields.items()},
            "before": {"type": "string", "description": "a new rule: place it just before this base rule"},
            "after": {"type": "string", "description": "a new rule: place it just after this base rule"},
            "remove": {"type": "boolean", "description": "true: drop the base rule of this name"},
        },
        "required": ["name"],
        "additionalProperties": False,
    }
    items = out["properties"]["rules"].pop("items")
    out["required"].remove("rules")
    out["if"] = {"required": ["extends"], "properties": {"extends": {"type": "string"}}}
    out["then"] = {"properties": {"rules": {"items": {"$ref": "#/$defs/RuleOverride"}}}}
    out["else"] = {"required": ["rules"], "properties": {"rules": {"items": items}}}


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"
