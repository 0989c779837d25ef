"""Printers: a :class:`Spec` back to YAML or the DSL, losslessly (``parse(dump(s)) == s``), in
one canonical layout — what ``geomopt fmt`` writes and ``geomopt fmt --check`` expects.

Only what differs from a default is written (``kind`` and the numbers that define the math, a reference's ε and κ, a
direction's α, always are); ``view: {kind: auto}`` prints as ``view: auto``, ``state: {dtype: int8}`` as ``state int8``
(``state: {dtype: bfloat16, compensation: int8}`` as ``state bfloat16(compensation=int8)``).

Canonical layout, the same elements in the same order in both spellings: ``geomopt``, ``name``,
``description``, ``defaults``, ``roles``, then the rules; in a rule ``match``, ``geometry``,
``constraint``, then its settings; in a mapping ``kind`` first, then a geometry's ``reference``,
then the fields in the model's order, a ``view`` last.

* YAML: block mappings down to each rule's fields (rules indented under ``rules:``); a mapping
  value below that is written in flow style (``{kind: adam, betas: [0.9, 0.95]}``) where it fits
  in 100 columns and holds no commented element, else in block style, and so on down; lists in
  flow style (a list of lists too long for one line: one ``- […]`` item a line). Match patterns
  and role patterns are always double-quoted; other strings are plain where YAML 1.1 and 1.2 both
  read them back as the same string, else double-quoted. Floats are Python's shortest round-trip
  spelling, with an exponent as ``1.0e-8`` (a ``.`` so that YAML 1.1 tools read a float too).
* DSL: one statement a line, a blank line before each rule, a rule's fields a line each indented
  four spaces; a statement, match or call holding a commented element is broken one item a line
  (a call's arguments with a trailing comma), so that each comment has its element's line.
  Exponents as ``1e-8``.

A spec that extends another (:mod:`geomopt.spec.extends`) prints as written: its own layer, each value it gives kept
even where it equals a default, ``extends`` after ``geomopt``, a rule's ``before``, ``after``, ``remove`` after its
``match``; ``resolved=True`` prints the merged spec.

Comments (:mod:`geomopt.spec.comments`), when given: the header (``$schema`` modeline first), each
own-line comment above its element, a trailing one after its first line, the footer last.
"""

from __future__ import annotations

import json
import math
import re
from typing import Optional

import yaml
from pydantic import BaseModel

from geomopt.spec.comments import Comments
from geomopt.spec.extends import layer_of
from geomopt.spec.base import KIND_FIELDS
from geomopt.spec.geometries import LogBarrier, PowerBarrier
from geomopt.spec.model import Spec
from geomopt.spec.updates import Polyak, Storm
from geomopt.spec.validate import source_of
from geomopt.spec.yaml_front import YamlDumper

_EXPLICIT = (LogBarrier, PowerBarrier, Polyak, Storm)  # their numbers define the math: always written

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_RESERVED = {"true", "false", "geomopt", "name", "description", "defaults", "roles", "rule", "match", "geometry",
             "constraint", "lr", "weight_decay", "decay", "direction", "post", "schedule", "on_nonfinite",
             "project_on_init", "qk_clip", "state", "extends", "before", "after", "remove"}

WIDTH = 100  # YAML: a mapping value fits in flow style on one line this long, or is written in block style
_RULE_HEAD = ("name", "match", "geometry", "post", "constraint")  # what the rule is before how it is tuned
_TOP = ("geomopt", "extends", "name", "description", "defaults", "roles", "rules")
_LAYER_RULE_HEAD = ("name", "match", "before", "after", "remove", "geometry", "post", "constraint")


def to_plain(model: BaseModel) -> dict:
    """Fields that differ from their defaults (``kind`` always), recursively, as plain data; the
    kind first, then a ``reference`` (a geometry's), then the other fields in order, a view last."""
    fields = type(model).model_fields
    out = {"kind": model.kind} if "kind" in fields else {}  # type: ignore[attr-defined]  # (BaseModel declares none)
    explicit = isinstance(model, _EXPLICIT)
    for name, field in fields.items():
        if field.exclude:  # not content (a spec's `extends`): model_dump() leaves it out too
            continue
        value = getattr(model, name)
        default = not field.is_required() and value == field.get_default(call_default_factory=True)
        if name == "kind" or (default and not (explicit and name in ("eps", "kappa", "alpha"))):
            continue
        out[name] = _plain(value)
    if "reference" in out:  # what the geometry is, then its reference (the DSL's positional argument)
        out = {**({"kind": out.pop("kind")} if "kind" in out else {}), "reference": out.pop("reference"), **out}
    if "view" in out:  # a base-class field, first in field order: print what the geometry is first
        out["view"] = out.pop("view")
    return out


def _plain(value):
    if isinstance(value, BaseModel):
        return to_plain(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _data(spec: Spec) -> dict:
    """The plain data both printers print, rules' fields in canonical order."""
    data = to_plain(spec)
    rules = []
    for rule in data["rules"]:
        head = {k: rule.pop(k) for k in _RULE_HEAD if k in rule}
        rules.append({**head, **rule})
    data["rules"] = rules
    return data


def layer_data(raw: dict) -> dict:
    """The plain data of an extending spec's own layer, as the printers print it: every value as
    given, shorthands expanded as the DSL reads them (``match: "p"``, ``view: auto``, ``decay:
    cautious``), in canonical order (top-level and rule keys as :data:`_TOP` and
    :data:`_LAYER_RULE_HEAD`, in a mapping ``kind`` first, a ``reference`` next, a ``view`` last,
    the rest as written)."""
    out = {k: raw[k] for k in _TOP if k in raw}
    for key in ("defaults", "roles"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _normal(v, k) for k, v in out[key].items()}
    if isinstance(out.get("rules"), list):
        rules = []
        for rule in out["rules"]:
            rule = {k: _normal(v, k) for k, v in rule.items()}
            rules.append({**{k: rule.pop(k) for k in _LAYER_RULE_HEAD if k in rule}, **rule})
        out["rules"] = rules
    return out


def _normal(value, field):
    """One layer value, shorthands expanded, a mapping's keys in canonical order."""
    if field == "match" and isinstance(value, str):
        return {"name": value}
    if isinstance(value, str) and field in KIND_FIELDS:
        return {"kind": value}
    if isinstance(value, list):
        return [_normal(v, field if field == "post" else None) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _normal(v, k) for k, v in value.items()}
    head = {k: out.pop(k) for k in ("kind", "reference") if k in out}
    tail = {"view": out.pop("view")} if "view" in out else {}
    return {**head, **out, **tail}


def printed_data(spec: Spec, resolved: bool = False) -> dict:
    """What the printers print: an extending spec's own layer (unless ``resolved``), else the spec."""
    layer = None if resolved else layer_of(source_of(spec))
    return _data(spec) if layer is None else layer_data(layer.data)


def _match_shorthand(match: dict) -> bool:
    return set(match) == {"name"}


def elements(data: dict) -> list[tuple]:
    """The elements (comment anchors, :mod:`geomopt.spec.comments`) the printers print, in order:
    every mapping key but ``kind`` and a rule's ``name``, and each rule; not the keys inside a
    ``match`` written as its pattern alone."""
    out: list[tuple] = [("geomopt",), *([("extends",)] if "extends" in data else []), ("name",)]
    if "description" in data:
        out.append(("description",))
    for top in ("defaults", "roles"):
        if data.get(top):
            out.append((top,))
            out += _keys(data[top], (top,))
    for i, rule in enumerate(data.get("rules", ())):
        path = ("rules", i)
        out.append(path)
        for key, value in rule.items():
            if key == "name":
                continue
            out.append(path + (key,))
            if not (key == "match" and _match_shorthand(value)):
                out += _keys(value, path + (key,))
    return out


def _keys(value, path) -> list[tuple]:
    out = []
    if isinstance(value, dict):
        for key, v in value.items():
            if key != "kind":
                out.append(path + (key,))
                out += _keys(v, path + (key,))
    return out


def dump_spec(spec: Spec, format: str = "yaml", comments: Optional[Comments] = None, *, resolved: bool = False) -> str:
    """``format``: "yaml" or "dsl". ``comments``: a file's comments
    (:func:`geomopt.spec.comments.collect`), printed on the elements they belong to. A spec that
    extends another prints as written (``extends`` kept), or merged where ``resolved``."""
    if format == "yaml":
        return dump_yaml(spec, comments, resolved=resolved)
    if format == "dsl":
        return dump_dsl(spec, comments, resolved=resolved)
    raise ValueError(f"format must be 'yaml' or 'dsl', got {format!r}")


def _float(value: float, dot: bool) -> str:
    """Shortest round-trip spelling; an exponent without zero padding (``1e-8``), its mantissa
    with a ``.`` where ``dot`` (``1.0e-8``: YAML 1.1 reads a float only with one)."""
    if not math.isfinite(value):
        raise ValueError(f"no spelling for {value!r} in a spec")
    text = repr(value)
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    if dot and "." not in mantissa:
        mantissa += ".0"
    sign = exponent[0] if exponent[0] in "+-" else ""
    return f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"


class _Lines:
    """Output lines, with the comments of the element each line starts."""

    def __init__(self, comments: Comments):
        self.comments = comments
        self.lines: list[str] = []

    def put(self, indent: int, text: str, path: Optional[tuple] = None) -> None:
        pad = " " * indent
        if path is not None:
            self.lines += [pad + c for c in self.comments.before.get(path, ())]
        trailing = self.comments.trailing.get(path) if path is not None else None
        self.lines.append(pad + text + (f"  {trailing}" if trailing else ""))

    def text(self) -> str:
        lines = [*self.comments.header_lines(), *self.lines]
        if self.comments.footer:
            lines += ["", *self.comments.footer]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- YAML


def _is_pattern(path: tuple) -> bool:
    """A match's name pattern (or its shorthand) or a role's pattern list: always quoted."""
    return (path[0] == "roles" and len(path) == 2) or (
        path[0] == "rules" and len(path) >= 3 and path[2] == "match" and (len(path) == 3 or path[3:] == ("name",)))


def _yaml_str(value: str, flow: bool, quote: bool) -> str:
    """A string as YAML: plain where safe in this context (``flow``: inside ``[…]``/``{…}``), else
    double-quoted (always where ``quote``)."""
    if not quote:
        doc = [value] if flow else {"k": value}
        text = yaml.dump(doc, Dumper=YamlDumper, default_flow_style=flow, allow_unicode=True, width=1 << 30)
        text = text[1:-2] if flow else text[3:-1]
        if not text.startswith(("'", '"')) and "\n" not in text:
            return text
    text = yaml.dump([value], Dumper=YamlDumper, default_flow_style=True, allow_unicode=True, width=1 << 30,
                     default_style='"')
    return text[1:-2]


def _yaml_scalar(value, flow: bool, quote: bool = False) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value, dot=True)
    if isinstance(value, str):
        return _yaml_str(value, flow, quote)
    raise TypeError(f"cannot print {value!r} in YAML")


def _yaml_flow(value, quote: bool = False) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_flow(v, quote and k == 'name')}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_flow(v, quote) for v in value) + "]"
    return _yaml_scalar(value, flow=True, quote=quote)


class _Yaml:
    def __init__(self, comments: Comments):
        self.out = _Lines(comments)
        self.comments = comments

    def item(self, key: str, value, path: tuple, indent: int) -> None:
        """``key: value`` at ``indent``, its value in flow style where it fits, else in block style."""
        quote = _is_pattern(path)
        head = f"{key}:"
        if isinstance(value, dict) and value:
            if not self.comments.has_inside(path):
                line = f"{head} {_yaml_flow(value, quote)}"
                if indent + len(line) <= WIDTH:
                    return self.out.put(indent, line, path)
            self.out.put(indent, head, path)
            for k, v in value.items():
                self.item(k, v, path + (k,), indent + 2)
        elif isinstance(value, list):
            line = f"{head} {_yaml_flow(value, quote)}"
            if indent + len(line) <= WIDTH or not any(isinstance(v, list) for v in value):
                return self.out.put(indent, line, path)
            self.out.put(indent, head, path)
            for v in value:
                self.out.put(indent + 2, f"- {_yaml_flow(v, quote)}")
        elif isinstance(value, dict):
            self.out.put(indent, f"{head} {{}}", path)
        else:
            self.out.put(indent, f"{head} {_yaml_scalar(value, flow=False, quote=quote)}", path)


def dump_yaml(spec: Spec, comments: Optional[Comments] = None, *, resolved: bool = False) -> str:
    data = printed_data(spec, resolved)
    comments = (comments or Comments()).resolve(elements(data))
    y = _Yaml(comments)
    for key in ("geomopt", "extends", "name", "description"):
        if key in data:
            y.item(key, data[key], (key,), 0)
    for key in ("defaults", "roles"):
        if data.get(key):
            y.out.put(0, f"{key}:", (key,))
            for k, v in data[key].items():
                y.item(k, v, (key, k), 2)
    if "rules" in data:
        y.out.put(0, "rules:")
    for i, rule in enumerate(data.get("rules", ())):
        path = ("rules", i)
        rule = dict(rule)
        if "match" in rule and _match_shorthand(rule["match"]):  # the common shorthand: match: "pattern"
            rule["match"] = rule["match"]["name"]
        if isinstance(rule.get("geometry"), dict) and rule["geometry"].get("view") == {"kind": "auto"}:
            rule["geometry"] = {**rule["geometry"], "view": "auto"}  # the shorthand the shipped specs use
        y.out.put(2, f"- name: {_yaml_scalar(rule.pop('name'), flow=False)}", path)
        for k, v in rule.items():
            y.item(k, v, path + (k,), 4)
    return y.out.text()


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
        return _float(value, dot=False)
    if isinstance(value, str):
        return value if _IDENT.match(value) and value not in _RESERVED else _string(value)
    if value is None:  # only an extending spec's YAML can say null (reset a base's value)
        raise ValueError("the DSL has no null (a spec that extends another resets a base's value with it): "
                         "keep this spec in YAML")
    raise TypeError(f"cannot print {value!r} in the DSL")


def _string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _value(value, field: str | None = None) -> str:
    if isinstance(value, dict):
        return value.get("dtype", "float32") if field == "state" and set(value) <= {"dtype"} else _call(value, field)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v, field if field == "post" else None) for v in value) + "]"
    return _scalar(value)


def _call(d: dict, field: str | None) -> str:
    kind, args = _args(d, field)
    if not args and field in KIND_FIELDS:
        return kind
    return f"{kind}({', '.join(f'{prefix}{_value(v, k)}' for k, prefix, v in args)})"


def _args(d: dict, field: str | None) -> tuple:
    """(kind, [(key, "key=" or "" for the positional reference, value)…]) of a call."""
    d = dict(d)
    kind = d.pop("dtype", "float32") if field == "state" else d.pop("kind")  # state bfloat16(compensation=int8)
    return kind, [(k, "" if (k == "reference" and field == "geometry") else f"{k}=", v) for k, v in d.items()]


class _Dsl:
    def __init__(self, comments: Comments):
        self.out = _Lines(comments)
        self.comments = comments

    def broken(self, path: tuple) -> bool:
        return self.comments.has_inside(path)

    def item(self, prefix: str, value, path: tuple, indent: int, field: str | None, suffix: str = "",
             text: str | None = None) -> None:
        """``prefix value suffix`` at ``indent``; a call holding a commented element one argument a line."""
        if isinstance(value, dict) and self.broken(path):
            kind, args = _args(value, field)
            self.out.put(indent, f"{prefix}{kind}(", path)
            for k, arg_prefix, v in args:
                self.item(arg_prefix, v, path + (k,), indent + 4, k, ",")
            self.out.put(indent, ")" + suffix)
        else:
            self.out.put(indent, prefix + (_value(value, field) if text is None else text) + suffix, path)

    def statement(self, keyword: str, items: list, path: tuple) -> None:
        """``defaults …`` / ``roles …``: ``key=value`` items on the keyword's line, or one a line."""
        if not self.broken(path):
            return self.out.put(0, " ".join([keyword, *(f"{k}={text}" for k, _, text in items)]), path)
        self.out.put(0, keyword, path)
        for k, v, text in items:
            self.item(f"{k}=", v, path + (k,), 4, k, text=text)


def dump_dsl(spec: Spec, comments: Optional[Comments] = None, *, resolved: bool = False) -> str:
    data = printed_data(spec, resolved)
    comments = (comments or Comments()).resolve(elements(data))
    d = _Dsl(comments)
    d.out.put(0, f"geomopt {data['geomopt']}", ("geomopt",))
    if "extends" in data:
        d.out.put(0, f"extends {_string(data['extends'])}", ("extends",))
    d.out.put(0, f"name {_string(data['name'])}", ("name",))
    if "description" in data:
        d.out.put(0, f"description {_string(data['description'])}", ("description",))
    defaults = data.get("defaults") or {}
    if defaults:
        d.statement("defaults", [(k, v, _value(v, k)) for k, v in defaults.items()], ("defaults",))
    roles = data.get("roles") or {}
    if roles:  # role names are plain words; patterns always quoted, as a match's name pattern is
        d.statement("roles", [(r, p, f"[{', '.join(_string(x) for x in p)}]") for r, p in roles.items()], ("roles",))
    for i, rule in enumerate(data.get("rules", ())):
        path = ("rules", i)
        rule = dict(rule)
        name, match = rule.pop("name"), rule.pop("match", None)
        mpath = path + ("match",)
        items = [(k, v, _string(v) if k == "name" else _value(v, k)) for k, v in (match or {}).items()]
        words = [text if k == "name" else f"{k}={text}" for k, _, text in items]
        d.out.lines.append("")
        if match is None:  # an override of a base rule (geomopt.spec.extends)
            d.out.put(0, f"rule {name}:", path)
        elif not (d.broken(mpath) or mpath in comments.before or mpath in comments.trailing):
            d.out.put(0, f"rule {name} match {' '.join(words)}:", path)
        else:
            d.out.put(0, f"rule {name}", path)
            if not d.broken(mpath):
                d.out.put(4, f"match {' '.join(words)}:", mpath)
            else:
                d.out.put(4, "match", mpath)
                for j, (k, v, text) in enumerate(items):
                    d.item("" if k == "name" else f"{k}=", v, mpath + (k,), 8, k, ":" if j == len(items) - 1 else "",
                           text=text)
        for k, v in rule.items():
            d.item(f"{k} " if k in ("geometry", "constraint") else f"{k}=", v, path + (k,), 4, k)
    return d.out.text()
