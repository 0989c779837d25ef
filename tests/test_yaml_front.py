"""The YAML front end: YAML 1.2 core-schema resolution, safe loading only, duplicate keys, and the
positions every diagnostic is built from (YAML's known traps: duplicate keys, implicit types)."""

from __future__ import annotations

import json
import math

import pytest

import geomopt
from geomopt.spec.diagnostics import Diagnostic, SpecError, language_diagnostic
from geomopt.spec.yaml_front import YamlDumper, parse_yaml

# (scalar as written, value it must load as). YAML 1.1 (PyYAML's default) gets most of these wrong.
SCALARS = [
    ("1e-3", 1e-3), ("1.0e-3", 1e-3), ("1E3", 1000.0), ("-2.5e+2", -250.0), (".5", 0.5), ("-.5", -0.5), ("+.5", 0.5),
    ("1.", 1.0), ("0.0", 0.0), ("3", 3), ("-7", -7), ("+4", 4), ("017", 17), ("0o17", 15), ("0x1F", 31), ("0x1f", 31),
    ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
    ("null", None), ("Null", None), ("~", None), ("", None),
    ("yes", "yes"), ("no", "no"), ("on", "on"), ("off", "off"), ("y", "y"), ("n", "n"), ("Yes", "Yes"), ("ON", "ON"),
    ("10:30", "10:30"), ("1:20:30", "1:20:30"), ("1_000", "1_000"), ("0b101", "0b101"), ("0o19", "0o19"),
    ("2001-12-14", "2001-12-14"), ("1e", "1e"), ("e3", "e3"), ("0x", "0x"), ("nan", "nan"), ("inf", "inf"),
    ("'1e-3'", "1e-3"), ('"true"', "true"), ("'null'", "null"), ('"10"', "10"), ("!!str 12", "12"), ("! 12", "12"),
    ("!!float 1", 1.0), ("!!int '3'", 3), ("!!bool 'false'", False), ("!!null ''", None),
    ("|\n  a\n  b", "a\nb\n"), (">-\n  a\n  b", "a b"), ("'it''s'", "it's"), ('"tab\\there"', "tab\there"),
]


@pytest.mark.parametrize("written, expected", SCALARS, ids=[s[0] for s in SCALARS])
def test_scalar_resolution(written, expected):
    value = parse_yaml(f"v: {written}\n").data["v"]
    assert type(value) is type(expected) and value == expected, (written, value)


@pytest.mark.parametrize("written, check", [(".inf", lambda v: v == math.inf), ("-.Inf", lambda v: v == -math.inf), (".NaN", math.isnan)])
def test_special_floats(written, check):
    value = parse_yaml(f"v: {written}\n").data["v"]
    assert isinstance(value, float) and check(value)


def test_dumper_quotes_what_the_loader_would_not_read_as_a_string():
    """The printer's quoting agrees with the loader (and with YAML 1.1 readers)."""
    import yaml

    for written, value in SCALARS:
        if isinstance(value, str):
            assert parse_yaml(yaml.dump({"v": value}, Dumper=YamlDumper)).data["v"] == value
    for word in ["yes", "no", "on", "off", "y", "N", "1e-3", "0o17", "0x1F", "10:30", "true", "null", "~", ""]:
        text = yaml.dump({"v": word}, Dumper=YamlDumper)
        assert "'" in text or '"' in text, text


SPEC = "geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '**'\n    geometry: {kind: euclidean}\n"


@pytest.mark.parametrize("value, ok", [("0.1", True), ("1e-3", True), (".5", True), ("1", True), ("0", True),
                                       ("yes", False), ("on", False), ("true", False), ("10:30", False),
                                       ("'0.1'", False), ("-1", False), (".inf", False), (".nan", False)])
def test_lr_values(value, ok):
    text = SPEC + f"    lr: {value}\n"
    if ok:
        assert geomopt.parse_spec(text).rules[0].lr == float(value)
    else:
        with pytest.raises(SpecError) as info:
            geomopt.parse_spec(text)
        d = info.value.diagnostics[0]
        assert (d.code, d.line, d.col) == ("GO005", 7, 9), d
        assert "rules[0].lr" in d.message


# ---------------------------------------------------------------- safe loading only

UNSAFE = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:os.system ['touch {marker}']",
    "!!python/name:os.system ''",
    "!!python/module:os ''",
    "!!python/object:argparse.Namespace {{a: 1}}",
    "!!python/tuple [1, 2]",
    "!!binary aGk=",
    "!!timestamp 2001-12-14",
    "!!set {{a, b}}",
    "!!omap [a: 1]",
    "!!pairs [a: 1]",
    "!custom x",
]


@pytest.mark.parametrize("tagged", UNSAFE)
def test_only_plain_data_is_loaded(tagged, tmp_path):
    marker = tmp_path / "marker"
    text = SPEC + f"    lr: {tagged.format(marker=marker)}\n"
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text)
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO005", 7, 9), d
    assert "tag" in d.message
    assert not marker.exists()


@pytest.mark.parametrize("text, message", [
    ("a: !!map [1]\n", "!!map does not fit a list"),
    ("a: !!seq {b: 1}\n", "!!seq does not fit a mapping"),
    ("a: !!str {b: 1}\n", "!!str does not fit a mapping"),
    ("a: !!int 1.5\n", "'1.5' is not a valid !!int"),
    ("a: !!float x\n", "'x' is not a valid !!float"),
    ("a: !!bool yes\n", "'yes' is not a valid !!bool"),
])
def test_explicit_core_tags_must_fit(text, message):
    with pytest.raises(SpecError) as info:
        parse_yaml(text)
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO005", 1, 4) and message in d.message


def test_aliases_expand_but_merge_keys_and_cycles_are_refused():
    shared = "geomopt: 1\nname: x\nrules:\n  - name: a\n    match: '*'\n    geometry: &g {kind: euclidean, radius: 2.0}\n  - name: b\n    match: '**'\n    geometry: *g\n"
    spec = geomopt.parse_spec(shared)
    assert spec.rules[0].geometry == spec.rules[1].geometry
    with pytest.raises(SpecError) as info:
        parse_yaml("a: &x {b: 1}\nc:\n  <<: *x\n")
    assert (info.value.diagnostics[0].line, info.value.diagnostics[0].col) == (3, 3)
    with pytest.raises(SpecError) as info:
        parse_yaml("a: &x [1, *x]\n")
    assert info.value.diagnostics[0].code == "GO005" and "recursive" in info.value.diagnostics[0].message


def test_alias_bomb_is_bounded():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i-1}"] * 10) + "]")
    with pytest.raises(SpecError) as info:
        parse_yaml("\n".join(lines) + "\n")
    assert info.value.diagnostics[0].code == "GO010" and "too large" in info.value.diagnostics[0].message


# ---------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize("text, line, col, first", [
    ("a: 1\nb: 2\na: 3\n", 3, 1, "line 1, column 1"),
    ("x:\n  k: 1\n  j: 2\n  k: 3\n", 4, 3, "line 2, column 3"),
    ("x: {k: 1, j: 2, k: 3}\n", 1, 17, "line 1, column 5"),
    ("- {a: 1}\n- a: 1\n  b: 2\n  a: 1\n", 4, 3, "line 2, column 3"),
    ("1: a\n'1': b\n", 2, 1, "line 1, column 1"),
    ("a: 1\n\"a\": 2\n", 2, 1, "line 1, column 1"),
])
def test_duplicate_keys_point_at_the_second(text, line, col, first):
    with pytest.raises(SpecError) as info:
        parse_yaml(text, "f.yaml")
    d = info.value.diagnostics[0]
    assert (d.code, d.file, d.line, d.col) == ("GO002", "f.yaml", line, col)
    assert first in d.message and "remove one" in d.message


def test_duplicate_rule_fields_through_parse_spec():
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(SPEC + "    geometry: {kind: adam}\n")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO002", 7, 5) and "'geometry'" in d.message and "line 6, column 5" in d.message


# ---------------------------------------------------------------- positions

NESTED = """\
# comment line
geomopt: 1
name: "demo"
rules:
  - name: hidden
    match: {name: "**.weight", ndim: [2, 3]}
    geometry:
      kind: spectral
      reference:
        kind: power_barrier
        kappa: 4
      approx: {kind: newton_schulz, steps: 5}
"""


@pytest.mark.parametrize("path, key, pos", [
    ((), False, (2, 1)),
    (("geomopt",), False, (2, 10)),
    (("geomopt",), True, (2, 1)),
    (("name",), False, (3, 7)),
    (("rules",), False, (5, 3)),
    (("rules", 0), False, (5, 5)),
    (("rules", 0, "name"), False, (5, 11)),
    (("rules", 0, "match"), False, (6, 12)),
    (("rules", 0, "match", "name"), False, (6, 19)),
    (("rules", 0, "match", "name"), True, (6, 13)),
    (("rules", 0, "match", "ndim", 1), False, (6, 42)),
    (("rules", 0, "geometry"), False, (8, 7)),
    (("rules", 0, "geometry"), True, (7, 5)),
    (("rules", 0, "geometry", "reference", "kappa"), False, (11, 16)),
    (("rules", 0, "geometry", "reference", "kappa"), True, (11, 9)),
    (("rules", 0, "geometry", "approx", "steps"), False, (12, 44)),
    # not in the file: the nearest recorded ancestor
    (("rules", 0, "geometry", "approx", "dtype"), False, (12, 15)),
    (("rules", 0, "constraint"), False, (5, 5)),
])
def test_positions_of_nested_values(path, key, pos):
    source = parse_yaml(NESTED).source
    assert source.pos(path, key=key) == pos


def test_crlf_and_bom_positions():
    text = "\ufeffgeomopt: 1\r\nname: x\r\nrules:\r\n  - name: a\r\n    match: '**'\r\n    geometry: {kind: spectrl}\r\n"
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text)
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO004", 6, 22)


def test_validation_errors_map_to_positions_and_are_sorted():
    text = SPEC.replace("{kind: euclidean}", "{kind: euclidean, radius: -1}") + "    lr: yes\n    weight_decay: -2\n"
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, file="s.yaml")
    got = [(d.code, d.line, d.col) for d in info.value.diagnostics]
    assert got == [("GO005", 6, 41), ("GO005", 7, 9), ("GO005", 8, 19)]
    assert str(info.value).splitlines()[0].startswith("s.yaml:6:41: error GO005 ")


# ---------------------------------------------------------------- diagnostics as data


def test_diagnostic_to_dict_and_format():
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec("geomopt: 1\nname: x\nrules: []\nfoo: 1\n", file="a.yaml")
    diags = info.value.diagnostics
    assert all(isinstance(d, Diagnostic) for d in diags)
    d = next(d for d in diags if d.code == "GO003")
    assert d.to_dict() == {"code": "GO003", "name": "unknown-field", "severity": "error", "message": d.message,
                           "file": "a.yaml", "line": 4, "col": 1}
    assert json.loads(json.dumps([x.to_dict() for x in diags]))[0]["file"] == "a.yaml"
    assert d.format() == str(d) == f"a.yaml:4:1: error GO003 {d.message}"
    assert str(info.value) == "\n".join(x.format() for x in diags)


def test_language_diagnostic_and_spec_error():
    d = language_diagnostic("GO007", "bad", "f", (3, 4))
    assert (d.code, d.name, d.severity, d.line, d.col) == ("GO007", "bad-pattern", "error", 3, 4)
    err = SpecError([d])
    assert isinstance(err, ValueError) and err.diagnostics == [d] and str(err) == "f:3:4: error GO007 bad"
    with pytest.raises(KeyError):
        language_diagnostic("GO999", "x")


def test_empty_documents():
    for text in ["", "\n\n", "# only\n", "---\n", "--- # c\n...\n", "\ufeff"]:
        with pytest.raises(SpecError) as info:
            parse_yaml(text)
        assert info.value.diagnostics[0].code == "GO009", repr(text)
    for text, what in [("~\n", "null"), ("- a\n", "a list"), ("3\n", "a number"), ("x\n", "a string")]:
        with pytest.raises(SpecError) as info:
            geomopt.parse_spec(text)
        assert info.value.diagnostics[0].code == "GO005" and info.value.diagnostics[0].message.endswith(f"not {what}")


def test_unknown_format_is_a_usage_error():
    with pytest.raises(ValueError, match="format"):
        geomopt.parse_spec(SPEC, "toml")
    with pytest.raises(ValueError, match="format"):
        geomopt.dump_spec(geomopt.parse_spec(SPEC), "json")
