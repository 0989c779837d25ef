"""Fuzzing both front ends: any text gives a Spec or a SpecError whose diagnostics are well formed
(code, severity, 1-based line and col inside the text) — never another exception.

Inputs: arbitrary text, soups of YAML/DSL tokens, and mutations of the shipped specs in both
spellings (characters and lines deleted, duplicated, swapped, replaced).
"""

from __future__ import annotations

import pathlib

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomopt
from geomopt.spec.diagnostics import LANGUAGE_CODES, SEVERITY_ORDER
from geomopt.spec.yaml_front import YamlDumper, parse_yaml
from spec_mutants import PUT_CHARS, TEXT_OPS, apply_text_op

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "specs").glob("*.yaml"))
YAML_TEXTS = [p.read_text(encoding="utf-8") for p in SHIPPED]
DSL_TEXTS = [geomopt.dump_spec(geomopt.load_spec(p), "dsl") for p in SHIPPED]
DSL_TEXTS += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.geom"))]  # hand-written
# spec-level roles and matrix views, which the shipped specs do not use
ROLES_YAML = """geomopt: 1
name: roles
roles: {head: ['re:.*\\.proj_out\\.weight', fc.weight], router: ['**.gate.weight']}
rules:
  - name: hidden
    match: {role: [hidden, expert], ndim: [2, 3]}
    geometry: {kind: spectral, reference: {kind: indicator}, view: {kind: matrix, batch: 1, blocks: [64, 32, 32]}}
  - name: rest
    match: {role: [embedding, head, router, norm, bias, other]}
    geometry: {kind: rowwise, reference: {kind: indicator}, view: auto}
"""
YAML_TEXTS.append(ROLES_YAML)
DSL_TEXTS.append(geomopt.dump_spec(geomopt.parse_spec(ROLES_YAML), "dsl"))
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def check(text: str, fmt: str):
    """parse_spec's contract on any input; returns the Spec or the SpecError."""
    try:
        spec = geomopt.parse_spec(text, fmt)
    except geomopt.SpecError as err:
        assert err.diagnostics, "SpecError without diagnostics"
        max_line = len(text.splitlines()) + 1  # splitlines knows every line break YAML does
        for d in err.diagnostics:
            assert d.code in LANGUAGE_CODES, d
            assert d.name == LANGUAGE_CODES[d.code][0]
            assert d.severity in SEVERITY_ORDER
            assert isinstance(d.line, int) and isinstance(d.col, int)
            assert 1 <= d.line <= max_line, (d, max_line)
            assert d.col >= 1, d
            assert isinstance(d.message, str) and d.message.strip()
            assert "__ANON" not in d.message and "Traceback" not in d.message
            assert d.to_dict()["code"] == d.code
        return err
    assert isinstance(spec, geomopt.Spec)
    # what parses also prints, and the print parses back to the same spec
    for out in ("yaml", "dsl"):
        assert geomopt.parse_spec(geomopt.dump_spec(spec, out), out) == spec
    return spec


# ---------------------------------------------------------------- arbitrary text


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_yaml(text):
    check(text, "yaml")


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_dsl(text):
    check(text, "dsl")


# ---------------------------------------------------------------- token soups

YAML_TOKENS = [
    "geomopt", "name", "rules", "defaults", "match", "geometry", "constraint", "kind", "reference", "approx",
    "lr", "spectral", "indicator", "1", "2", "0", "-1", "1e-3", ".5", "yes", "on", "null", "~", "true", "10:30",
    "0x1F", "0o17", ":", ": ", "- ", "-", "\n", "\n  ", "\n    ", "  ", "\t", "{", "}", "[", "]", ",", "'", '"',
    "#", "&a", "*a", "<<", "!!python/object:x", "!!int", "!tag", "?", "|", ">", "---", "...", "%YAML 1.2", "\\",
    "\x85", "\u2028", "\ufeff", "é", "re:a((", "**", "\x00", "\x07", "role", "roles", "hidden", "view", "auto",
    "blocks",
]
DSL_TOKENS = [
    "geomopt", "name", "description", "defaults", "rule", "match", "geometry", "constraint", "lr", "direction",
    "schedule", "weight_decay", "project_on_init", "on_nonfinite", "spectral", "indicator", "polyak", "kind",
    "approx", "newton_schulz", "radius", "module", "ndim", "true", "false", "none", "1", "-0.5", "1e-3", "2.",
    ".5", "+3", "(", ")", "[", "]", ",", "=", ":", '"', '"x"', '"\\u00e9"', '"\\ud800"', '"\\q"', "#", "\n",
    " ", "\t", "@", ";", "'", "x", "a-b", "_", "\x00", "é", "{", "}", "roles", "role", "hidden", "head", "view",
    "auto", "matrix", "blocks", "batch", "qk_clip", "max_logit", "tau",
]


@FUZZ
@given(st.lists(st.sampled_from(YAML_TOKENS), max_size=60).map("".join))
def test_yaml_token_soup(text):
    check(text, "yaml")


@FUZZ
@given(st.lists(st.sampled_from(DSL_TOKENS), max_size=60).map(" ".join))
def test_dsl_token_soup(text):
    check(text, "dsl")


@FUZZ
@given(st.lists(st.sampled_from(DSL_TOKENS), max_size=60).map("".join))
def test_dsl_token_soup_unspaced(text):
    check(text, "dsl")


# ---------------------------------------------------------------- mutations of shipped specs


@st.composite
def mutated(draw, texts):
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(TEXT_OPS))
        text = apply_text_op(text, op, lambda n: draw(st.integers(0, n - 1)),
                             lambda: draw(st.one_of(st.sampled_from(list(PUT_CHARS)), st.characters())))
    return text


@FUZZ
@given(mutated(YAML_TEXTS))
def test_mutated_yaml(text):
    check(text, "yaml")


@FUZZ
@given(mutated(DSL_TEXTS))
def test_mutated_dsl(text):
    check(text, "dsl")


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from(["", "spectral", "kind", "re:a((", "**", "yes", "1e-3", "polyak", "frobenius_ball", "auto", "hidden"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["kind", "name", "radius", "reference", "lr", "k", "x", "match", "geometry", "role", "head", "view", "blocks"]), inner, max_size=3)),
    max_leaves=8,
)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


@st.composite
def replaced(draw):
    """A shipped spec as data with one value (anywhere) replaced by random JSON-like data, so the
    pydantic-error → position mapping meets every shape of wrong value."""
    data = parse_yaml(draw(st.sampled_from(YAML_TEXTS))).data
    path = draw(st.sampled_from(list(_paths(data))[1:]))
    node = data
    for p in path[:-1]:
        node = node[p]
    if draw(st.booleans()) or not isinstance(node, dict):
        node[path[-1]] = draw(JSON)
    else:  # or rename the key
        node[draw(st.sampled_from(["kind", "nmae", "radius", "geometri", "x"]))] = node.pop(path[-1])
    return yaml.dump(data, Dumper=YamlDumper, sort_keys=False)


@FUZZ
@given(replaced())
def test_wrong_values_anywhere(text):
    check(text, "yaml")


@FUZZ
@given(st.sampled_from(YAML_TEXTS + DSL_TEXTS), st.sampled_from(["yaml", "dsl"]))
def test_wrong_format_is_a_finding(text, fmt):
    """A spec given to the other front end is a clean error (or, for YAML, never a crash)."""
    check(text, fmt)


def test_unmutated_shipped_specs_parse():
    assert len(YAML_TEXTS) >= 5 and len(DSL_TEXTS) >= len(YAML_TEXTS)
    for text in YAML_TEXTS:
        assert isinstance(check(text, "yaml"), geomopt.Spec)
    for text in DSL_TEXTS:
        assert isinstance(check(text, "dsl"), geomopt.Spec)
