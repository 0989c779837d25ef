"""Printers: a :class:`Spec` back to YAML or the DSL, losslessly (``parse(dump(s)) == s``).

Only what differs from a default is written (``kind`` always), so printed specs stay short —
except the numbers that define the math (a reference's ε and κ, a direction's α), which are
always written out. ``view: {kind: auto}`` prints as its shorthand ``view: auto`` (DSL ``view=auto``).
"""

from __future__ import annotations

import json
import math
import re

import yaml
from pydantic import BaseModel

from geomopt.spec.dsl_front import KIND_FIELDS
from geomopt.spec.model import LogBarrier, Polyak, PowerBarrier, Spec, Storm

_EXPLICIT = (LogBarrier, PowerBarrier, Polyak, Storm)
from geomopt.spec.yaml_front import YamlDumper

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_RESERVED = {"true", "false", "geomopt", "name", "description", "defaults", "roles", "rule", "match", "geometry",
             "constraint", "lr", "weight_decay", "direction", "schedule", "on_nonfinite", "project_on_init"}


def to_plain(model: BaseModel) -> dict:
    """Fields that differ from their defaults (``kind`` always), recursively, as plain data."""
    fields = type(model).model_fields
    out = {"kind": model.kind} if "kind" in fields else {}
    explicit = isinstance(model, _EXPLICIT)
    for name, field in fields.items():
        value = getattr(model, name)
        default = not field.is_required() and value == field.get_default(call_default_factory=True)
        if name == "kind" or (default and not (explicit and name in ("eps", "kappa", "alpha"))):
            continue
        out[name] = _plain(value)
    if "view" in out:  # a base-class field, first in field order: print what the geometry is first
        out["view"] = out.pop("view")
    return out


def _plain(value):
    if isinstance(value, BaseModel):
        return to_plain(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def dump_spec(spec: Spec, format: str = "yaml") -> str:
    """``format``: "yaml" or "dsl"."""
    if format == "yaml":
        return dump_yaml(spec)
    if format == "dsl":
        return dump_dsl(spec)
    raise ValueError(f"format must be 'yaml' or 'dsl', got {format!r}")


def dump_yaml(spec: Spec) -> str:
    data = to_plain(spec)
    rules = []
    for rule in data["rules"]:
        m = rule.get("match", {})
        if set(m) == {"name"}:  # the common shorthand: match: "pattern"
            rule["match"] = m["name"]
        if rule["geometry"].get("view") == {"kind": "auto"}:  # the shorthand the shipped specs use
            rule["geometry"]["view"] = "auto"
        # what the rule is before how it is tuned, as the shipped specs read
        head = {k: rule.pop(k) for k in ("name", "match", "geometry", "constraint") if k in rule}
        rules.append({**head, **rule})
    data["rules"] = rules
    # One document: the top level always holds the rules list, so it prints in block style (dumped
    # on its own, `name: x` alone would print as the flow mapping `{name: x}`).
    return yaml.dump(data, Dumper=YamlDumper, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)


# ---------------------------------------------------------------- DSL


def _scalar(value) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"the DSL has no spelling for {value!r}")
        return repr(value)
    if isinstance(value, str):
        return value if _IDENT.match(value) and value not in _RESERVED else json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot print {value!r} in the DSL")


def _value(value, field: str | None = None) -> str:
    if isinstance(value, dict):
        return _call(value, field)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return _scalar(value)


def _call(d: dict, field: str | None) -> str:
    d = dict(d)
    kind = d.pop("kind")
    args = []
    if field == "geometry" and "reference" in d:
        args.append(_value(d.pop("reference"), "reference"))
    args += [f"{k}={_value(v, k)}" for k, v in d.items()]
    if not args and field in KIND_FIELDS:
        return kind
    return f"{kind}({', '.join(args)})"


def _settings(d: dict) -> list[str]:
    return [f"{k}={_value(v, k)}" for k, v in d.items()]


def dump_dsl(spec: Spec) -> str:
    data = to_plain(spec)
    lines = [f"geomopt {data['geomopt']}", f"name {json.dumps(data['name'], ensure_ascii=False)}"]
    if "description" in data:
        lines.append(f"description {json.dumps(data['description'], ensure_ascii=False)}")
    defaults = data.get("defaults") or {}
    if defaults:
        lines.append("defaults " + " ".join(_settings(defaults)))
    roles = data.get("roles") or {}
    if roles:  # role names are plain words; patterns always quoted, as a match's name pattern is
        lines.append("roles " + " ".join(
            f"{role}=[{', '.join(json.dumps(p, ensure_ascii=False) for p in patterns)}]" for role, patterns in roles.items()))
    for rule in data["rules"]:
        rule = dict(rule)
        match = rule.pop("match")
        head = [f"rule {rule.pop('name')} match"]
        if "name" in match:
            head.append(json.dumps(match.pop("name"), ensure_ascii=False))
        head += [f"{k}={_value(v, k)}" for k, v in match.items()]
        lines.append("")
        lines.append(" ".join(head) + ":")
        lines.append(f"    geometry {_value(rule.pop('geometry'), 'geometry')}")
        if "constraint" in rule:
            lines.append(f"    constraint {_value(rule.pop('constraint'), 'constraint')}")
        lines += [f"    {s}" for s in _settings(rule)]
    return "\n".join(lines) + "\n"

