"""A seeded, deterministic generator of mutated specs in both spellings (YAML and the DSL).

``mutant(seed, i)`` is a pure function of its arguments: the same (seed, i) gives the same text on
every machine, so any finding is replayed from two integers. Four levels of mutation:

- ``struct``: a valid spec as data, changed 1–3 times where the schema says what may go
  (schema/geomopt-1.schema.json): a value replaced by another of its type (often valid, sometimes
  0, negative, huge, tiny, nan, ±inf, a string, a list), a ``kind`` swapped within its family,
  a property added or dropped, rules dropped, duplicated or reordered, a catch-all or ``roles``
  added, ``extends`` put in front. Printed as YAML, or as the DSL when it still parses.
- ``token``: YAML/DSL tokens of a spec's text replaced by, or swapped with, the vocabulary's.
- ``text``: characters and lines deleted, duplicated, swapped, replaced; the file cut short.
- ``mixed``: ``struct`` then ``text``.
"""

from __future__ import annotations

import copy
import json
import pathlib
import random
import re

import yaml

import geomopt

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
SCHEMA = json.loads((ROOT / "schema" / "geomopt-1.schema.json").read_text(encoding="utf-8"))
DEFS = SCHEMA["$defs"]


def _bases() -> list[tuple[str, str, dict]]:
    """(name, YAML text, data) of every shipped, catalogue and example spec."""
    out = []
    for path in sorted(SPECS.glob("*.yaml")) + sorted((SPECS / "catalog").glob("*.yaml")) + \
            sorted((SPECS / "examples").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        out.append((path.stem, text, yaml.safe_load(text)))
    return out


BASES = _bases()
YAML_TEXTS = [t for _, t, _ in BASES]
DSL_TEXTS = [geomopt.dump_spec(geomopt.parse_spec(t), "dsl") for t in YAML_TEXTS]
DSL_TEXTS += [p.read_text(encoding="utf-8") for p in sorted(SPECS.glob("*.geom"))]
SHIPPED_NAMES = sorted({name for name, _, _ in BASES if (SPECS / f"{name}.yaml").exists()})

# ---------------------------------------------------------------- the schema's vocabulary


def _kind_of(d: dict):
    return d.get("properties", {}).get("kind", {}).get("const")


KIND_DEF = {}  # kind → [def names] (a kind such as "storm" names a direction and a schedule)
FAMILY = {}  # def name → the defs of its discriminated union
PROPS: dict[str, list] = {}  # property name → every subschema it has anywhere
for _name, _d in DEFS.items():
    if _kind_of(_d):
        KIND_DEF.setdefault(_kind_of(_d), []).append(_name)
    for _prop, _sub in _d.get("properties", {}).items():
        PROPS.setdefault(_prop, []).append(_sub)
for _prop, _sub in SCHEMA["properties"].items():
    PROPS.setdefault(_prop, []).append(_sub)


def _walk_unions(node):
    if isinstance(node, dict):
        if "discriminator" in node:
            members = [ref.rsplit("/", 1)[1] for ref in node["discriminator"]["mapping"].values()]
            for m in members:
                FAMILY[m] = members
        for v in node.values():
            _walk_unions(v)
    elif isinstance(node, list):
        for v in node:
            _walk_unions(v)


_walk_unions(SCHEMA)

EDGE_NUMBERS = [0, 0.0, -0.0, -1, -1e-3, 1e308, 1e300, -1e300, 1e-300, 5e-324, float("nan"), float("inf"),
                float("-inf"), 2**63, 10**400, True, "1e-3", "nan", None, [], {}]
GOOD_NUMBERS = [1e-300, 1e-12, 1e-8, 1e-3, 0.05, 0.1, 0.5, 0.9, 0.95, 0.999, 1, 1.0, 2.0, 3.5, 10.0, 1e3, 1e6, 1e30]
GOOD_INTS = [0, 1, 2, 3, 4, 5, 8, 16, 64, 300, 10**6]
PATTERNS = ["**", "*", "*.weight", "**.weight", "**.bias", "layers.*.weight", "transformer.h.*.attn.c_attn.weight",
            "transformer.wte.weight", "head.weight", "features.*.weight", "re:.*", "re:.*\\.weight",
            "re:(a|b", "re:(a+)+$", "re:(x*)*y", "re:[", "re:", "", "**.**", "[abc]", "a{1,3}", "?",
            "lm_head.weight", "model.layers.*.self_attn.q_proj.weight", "é", "re:(?P<x>a)", "re:\\", "**.*"]
STRINGS = PATTERNS + ["spectral", "auto", "matrix", "hidden", "muon", "x", "yes", "none", "null", "1e-3", "kind",
                      "float32", "bfloat16", "float16", "float64", "int8", "cols", "batch", "in_out", "out_in"]
ROLES = ["embedding", "head", "router", "expert", "norm", "bias", "hidden", "other", "nothing"]


def _resolve(sch: dict) -> dict:
    while "$ref" in sch:
        parts = sch["$ref"].lstrip("#/").split("/")
        node = SCHEMA
        for p in parts:
            node = node[p]
        sch = node
    return sch


def _number(rng: random.Random, sch: dict, integer: bool):
    if rng.random() < 0.15:
        return rng.choice(EDGE_NUMBERS)
    pool = GOOD_INTS if integer else GOOD_NUMBERS
    lo, hi = sch.get("minimum", sch.get("exclusiveMinimum")), sch.get("maximum", sch.get("exclusiveMaximum"))
    ok = [v for v in pool if (lo is None or v >= lo) and (hi is None or v <= hi)
          and not (v == sch.get("exclusiveMinimum") or v == sch.get("exclusiveMaximum"))]
    return rng.choice(ok or pool)


def gen(rng: random.Random, sch: dict, depth: int = 0):
    """A value for schema ``sch``: mostly one it allows, now and then an edge case it does not."""
    sch = _resolve(sch)
    for key in ("anyOf", "oneOf"):
        if key in sch:
            return gen(rng, rng.choice(sch[key]), depth)
    if "const" in sch:
        return sch["const"]
    if "enum" in sch:
        return rng.choice(sch["enum"] + (["bogus"] if rng.random() < 0.05 else []))
    kind = sch.get("type")
    if kind == "number":
        return _number(rng, sch, False)
    if kind == "integer":
        return _number(rng, sch, True)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "string":
        return rng.choice(STRINGS)
    if kind == "array":
        items = sch.get("items", {"type": "string"})
        n = rng.choice([max(1, sch.get("minItems", 0)), 1, 2, 3, 0])
        return [gen(rng, items, depth + 1) for _ in range(n)]
    if kind == "object" and depth < 4:
        props = sch.get("properties", {})
        out = {}
        for name, sub in props.items():
            if name == "kind" or name in sch.get("required", ()) or rng.random() < 0.25:
                out[name] = gen(rng, sub, depth + 1)
        return out
    return rng.choice(STRINGS)


def _nodes(data, path=()):
    """Every (path, value) below ``data``."""
    yield path, data
    if isinstance(data, dict):
        for k, v in list(data.items()):
            yield from _nodes(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _nodes(v, path + (i,))


def _parent(data, path):
    node = data
    for p in path[:-1]:
        node = node[p]
    return node


def _set_value(rng, data):
    """A key's value replaced by another its schema allows (or an edge case)."""
    keyed = [(p, v) for p, v in _nodes(data) if p and isinstance(p[-1], str) and p[-1] != "kind"]
    if not keyed:
        return
    path, _ = rng.choice(keyed)
    parent = _parent(data, path)
    subs = PROPS.get(path[-1])
    if path[-1] == "name" and "rules" not in path:
        value = rng.choice(["x", "", "muon"])
    elif path[-1] == "name" and len(path) >= 2 and path[-2] == "match":
        value = rng.choice(PATTERNS)
    elif path[-1] == "role" or (len(path) >= 2 and path[-2] == "role"):
        value = rng.choice(ROLES) if rng.random() < 0.6 else rng.sample(ROLES[:8], rng.randint(1, 3))
    elif subs and rng.random() < 0.85:
        value = gen(rng, rng.choice(subs))
    else:
        value = rng.choice(EDGE_NUMBERS + STRINGS[:6])
    parent[path[-1]] = value


def _swap_kind(rng, data):
    """A ``kind`` replaced by another of its family, keeping (or not) the other properties."""
    kinded = [(p, v) for p, v in _nodes(data) if isinstance(v, dict) and isinstance(v.get("kind"), str)]
    if not kinded:
        return
    path, node = rng.choice(kinded)
    defs = KIND_DEF.get(node["kind"], [])
    family = FAMILY.get(defs[0], list(DEFS)) if defs else list(DEFS)
    new = rng.choice(family)
    if rng.random() < 0.6:  # a fresh value of the new kind (often valid)
        fresh = gen(rng, DEFS[new])
        if path:
            _parent(data, path)[path[-1]] = fresh
        return
    node["kind"] = _kind_of(DEFS[new]) or "bogus"


def _add_prop(rng, data):
    """A property its kind allows (or any property name) added with a generated value."""
    kinded = [v for _, v in _nodes(data) if isinstance(v, dict) and isinstance(v.get("kind"), str)]
    rules = data.get("rules") if isinstance(data.get("rules"), list) else []
    targets = kinded + [r for r in rules if isinstance(r, dict)]
    if not targets:
        return
    node = rng.choice(targets)
    if "kind" in node and node["kind"] in KIND_DEF and rng.random() < 0.8:
        props = DEFS[KIND_DEF[node["kind"]][0]].get("properties", {})
    else:
        props = DEFS["Rule"]["properties"]
    name = rng.choice(sorted(props))
    if name != "kind":
        node[name] = gen(rng, props[name])


def _drop_key(rng, data):
    keyed = [p for p, _ in _nodes(data) if p and not isinstance(p[-1], int) and p[0] != "geomopt"]
    if keyed:
        path = rng.choice(keyed)
        del _parent(data, path)[path[-1]]


def _rules_op(rng, data):
    """Rules dropped, duplicated (same name or renamed), reordered; a catch-all or roles added."""
    rules = data.get("rules")
    if not isinstance(rules, list) or not rules:
        return
    op = rng.choice(["drop", "dup", "dup_renamed", "swap", "reverse", "catch_all", "roles", "geometry"])
    i, j = rng.randrange(len(rules)), rng.randrange(len(rules))
    if op == "drop":
        del rules[i]
    elif op in ("dup", "dup_renamed"):
        rule = copy.deepcopy(rules[i])
        if op == "dup_renamed" and isinstance(rule, dict):
            rule["name"] = f"{rule.get('name', 'r')}_{rng.randint(0, 9)}"
        rules.insert(j, rule)
    elif op == "swap":
        rules[i], rules[j] = rules[j], rules[i]
    elif op == "reverse":
        rules.reverse()
    elif op == "catch_all":
        rules.insert(j, {"name": f"all{rng.randint(0, 9)}", "match": rng.choice(["**", "*.weight", "re:.*"]),
                         "geometry": gen(rng, DEFS[rng.choice(FAMILY["Spectral"])])})
    elif op == "roles":
        data["roles"] = {rng.choice(ROLES): rng.sample(PATTERNS, rng.randint(1, 2)) for _ in range(rng.randint(1, 2))}
    elif isinstance(rules[i], dict):  # a new geometry from the schema
        rules[i]["geometry"] = gen(rng, DEFS[rng.choice(FAMILY["Spectral"])])


def _extends_op(rng, data):
    """``extends`` a shipped spec (or a name that is none), its rules now overrides or additions."""
    data["extends"] = rng.choice(SHIPPED_NAMES + ["nosuchspec", "./missing.yaml", "", "/dev/null"])
    rules = data.get("rules")
    if isinstance(rules, list) and rules:
        keep = rng.sample(rules, rng.randint(0, min(2, len(rules))))
        for rule in keep:
            if isinstance(rule, dict) and rng.random() < 0.3:
                rule[rng.choice(["remove", "before", "after"])] = rng.choice([True, "hidden", "rest", "nosuch"])
        data["rules"] = keep
        if not keep and rng.random() < 0.5:
            del data["rules"]


STRUCT_OPS = [(_set_value, 5), (_swap_kind, 3), (_add_prop, 3), (_drop_key, 1), (_rules_op, 3), (_extends_op, 1)]


def structured(rng: random.Random) -> tuple[str, str, list[str]]:
    """(format, text, ops) of a shipped spec changed 1–3 times as data."""
    data = copy.deepcopy(rng.choice(BASES)[2])
    ops = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.choices([f for f, _ in STRUCT_OPS], [w for _, w in STRUCT_OPS])[0]
        op(rng, data)
        ops.append(op.__name__.lstrip("_"))
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)
    if rng.random() < 0.5:  # the DSL spelling of the same spec, where it has one
        try:
            return "dsl", geomopt.dump_spec(geomopt.parse_spec(text), "dsl"), ops + ["as_dsl"]
        except (geomopt.SpecError, ValueError):  # ValueError: dump_spec's "the DSL has no null"
            pass
    return "yaml", text, ops


# ---------------------------------------------------------------- text and token levels

TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_][A-Za-z_0-9.]*|[-+]?(?:\d[\w.+-]*|\.\d[\w.+-]*)|\s+|.', re.S)
VOCAB = sorted(set(KIND_DEF) | {p for p in PROPS} | set(ROLES)) + ["true", "false", "none", "null", "yes", "~"]
NUMBER_TOKENS = ["0", "-1", "1", "2", "0.5", "1e-300", "1e308", "1e999", "-0.0", ".nan", "nan", "inf", "-.inf",
                 "0x1F", "3", "64", "10_000"]
PUNCT = {"yaml": [":", ": ", "- ", "{", "}", "[", "]", ",", "'", '"', "#", "&a", "*a", "|", ">", "!!str", "?"],
         "dsl": ["(", ")", "[", "]", ",", "=", ":", '"', '"**"', '"re:(a+)+$"', "#", "@", ";"]}


def token_mutation(rng: random.Random) -> tuple[str, str, list[str]]:
    fmt = rng.choice(["yaml", "dsl"])
    text = rng.choice(YAML_TEXTS if fmt == "yaml" else DSL_TEXTS)
    tokens = TOKEN.findall(text)
    ops = []
    for _ in range(rng.randint(1, 3)):
        solid = [k for k, t in enumerate(tokens) if not t.isspace()]
        if not solid:
            break
        k = rng.choice(solid)
        op = rng.choice(["word", "word", "number", "punct", "delete", "dup", "swap"])
        if op == "word":
            tokens[k] = rng.choice(VOCAB)
        elif op == "number":
            tokens[k] = rng.choice(NUMBER_TOKENS)
        elif op == "punct":
            tokens[k] = rng.choice(PUNCT[fmt])
        elif op == "delete":
            tokens[k] = ""
        elif op == "dup":
            tokens[k] = tokens[k] * 2 if rng.random() < 0.5 else tokens[k] + " " + tokens[k]
        else:
            m = rng.choice(solid)
            tokens[k], tokens[m] = tokens[m], tokens[k]
        ops.append("token_" + op)
    return fmt, "".join(tokens), ops


TEXT_OPS = ("del_char", "dup_char", "swap_chars", "put_char", "del_line", "dup_line", "swap_lines", "cut")
#: characters a put_char edit draws from (hypothesis adds any character)
PUT_CHARS = ":-{}[]()=,\"'#\t\n &*!|>%@\\"


def apply_text_op(text: str, op: str, pick, char) -> str:
    """One edit of ``text`` (:data:`TEXT_OPS`): ``pick(n)`` chooses an index below n (two per
    edit, then ``char()`` for put_char), so a seeded generator and hypothesis share the edits."""
    if op.endswith(("line", "lines")):
        lines = text.split("\n")
        i, j = pick(len(lines)), pick(len(lines))
        if op == "del_line":
            del lines[i]
        elif op == "dup_line":
            lines.insert(i, lines[i])
        else:
            lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if not text:
        return text
    i, j = pick(len(text)), pick(len(text))
    if op == "del_char":
        return text[:i] + text[i + 1:]
    if op == "dup_char":
        return text[:i] + text[i] + text[i:]
    if op == "swap_chars":
        chars = list(text)
        chars[i], chars[j] = chars[j], chars[i]
        return "".join(chars)
    if op == "put_char":
        return text[:i] + char() + text[i:]
    return text[:i]  # cut: the file ends early


def text_mutation(rng: random.Random, text: str, n: int) -> tuple[str, list[str]]:
    ops = []
    for _ in range(n):
        op = rng.choice(list(TEXT_OPS))
        ops.append(op)
        text = apply_text_op(text, op, rng.randrange, lambda: rng.choice(PUT_CHARS + "é\x00\u2028"))
    return text, ops


def mutant(seed: int, i: int) -> tuple[str, str, str, list[str]]:
    """(level, format, text, ops) of mutant ``i`` of ``seed``; deterministic."""
    rng = random.Random(f"geomopt-fuzz/{seed}/{i}")
    level = rng.choices(["struct", "token", "text", "mixed"], [55, 20, 15, 10])[0]
    if level in ("struct", "mixed"):
        fmt, text, ops = structured(rng)
        if level == "mixed":
            text, more = text_mutation(rng, text, rng.randint(1, 2))
            ops += more
    elif level == "token":
        fmt, text, ops = token_mutation(rng)
    else:
        fmt = rng.choice(["yaml", "dsl"])
        text, ops = text_mutation(rng, rng.choice(YAML_TEXTS if fmt == "yaml" else DSL_TEXTS), rng.randint(1, 4))
    return level, fmt, text, ops


