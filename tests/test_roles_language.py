"""Roles and matrix views in the language: ``match: {role: …}``, a geometry's ``view`` (``auto`` or
a ``matrix(…)``) and the spec-level ``roles`` mapping read the same from YAML and the DSL, print
back losslessly, validate against the JSON Schema, and point their errors at file:line:col."""

from __future__ import annotations

import json
import pathlib

import pytest

import geomopt
from geomopt.spec.geometries import VIEW_KINDS, AutoView, Euclidean, Indicator, MatrixView, Spectral
from geomopt.spec.model import ROLE_NAMES, Match, Rule, Spec
from geomopt.spec.dsl_front import parse_dsl
from geomopt.spec.schema import schema
from geomopt.spec.yaml_front import parse_yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent

YAML = r"""geomopt: 1
name: roles-demo
roles:
  head: ['re:.*\.proj_out\.weight', fc.weight]
  router: ['**.gate.weight']
rules:
  - name: hidden
    match: {role: [hidden, expert], ndim: [2, 3]}
    geometry:
      kind: spectral
      reference: {kind: indicator}
      approx: {kind: newton_schulz}
      view: auto
  - name: fused
    match: {role: hidden, name: '**.qkv.weight'}
    geometry: {kind: rowwise, reference: {kind: indicator}, view: {kind: matrix, batch: 1, trailing: batch, blocks: [64, 32, 32]}}
  - name: heads
    match: {role: head}
    geometry: {kind: anisotropic, reference: {kind: indicator}, view: {kind: matrix, blocks: 4}}
  - name: rest
    match: '**'
    geometry: {kind: columnwise, reference: {kind: indicator}, view: matrix}
"""

DSL = r"""geomopt 1
name "roles-demo"
roles head=["re:.*\\.proj_out\\.weight", "fc.weight"] router=["**.gate.weight"]
rule hidden match role=[hidden, expert] ndim=[2, 3]:
    geometry spectral(indicator, approx=newton_schulz, view=auto)
rule fused match role=hidden name="**.qkv.weight":
    geometry rowwise(indicator, view=matrix(batch=1, trailing=batch, blocks=[64, 32, 32]))
rule heads match role=head:
    geometry anisotropic(indicator, view=matrix(blocks=4))
rule rest match "**":
    geometry columnwise(indicator, view=matrix)
"""


def test_yaml_and_dsl_read_the_same_models():
    spec = geomopt.parse_spec(YAML, "yaml")
    assert geomopt.parse_spec(DSL, "dsl") == spec
    assert spec.roles == {"head": ["re:.*\\.proj_out\\.weight", "fc.weight"], "router": ["**.gate.weight"]}
    hidden, fused, heads, rest = spec.rules
    assert hidden.match == Match(role=["hidden", "expert"], ndim=[2, 3])
    assert hidden.geometry.view == AutoView()
    assert fused.match.role == "hidden" and fused.match.name == "**.qkv.weight"
    assert fused.geometry.view == MatrixView(batch=1, trailing="batch", blocks=[64, 32, 32])
    assert heads.geometry.view == MatrixView(blocks=4)
    assert rest.geometry.view == MatrixView()  # `view: matrix`: the shorthand names any view kind


def test_printed_forms():
    """AutoView prints as the shorthand, MatrixView as a mapping / call, roles before the rules."""
    spec = geomopt.parse_spec(YAML, "yaml")
    y = geomopt.dump_spec(spec, "yaml")
    assert "view: auto\n" in y and "view: {kind: matrix}" in y and "role: [hidden, expert]" in y
    assert y.index("roles:") < y.index("rules:")
    d = geomopt.dump_spec(spec, "dsl")
    assert 'roles head=["re:.*\\\\.proj_out\\\\.weight", "fc.weight"] router=["**.gate.weight"]\n' in d
    assert "rule hidden match role=[hidden, expert] ndim=[2, 3]:" in d
    assert "view=auto)" in d and "view=matrix(batch=1, trailing=batch, blocks=[64, 32, 32])" in d
    assert "view=matrix)" in d and "view=matrix(blocks=4)" in d
    assert d.index("roles ") < d.index("rule ")


@pytest.mark.parametrize("text, fmt", [(YAML, "yaml"), (DSL, "dsl")])
def test_round_trips(text, fmt):
    """YAML → DSL → YAML (and the other way) gives the same spec, and printing is a fixed point."""
    spec = geomopt.parse_spec(text, fmt)
    dsl = geomopt.dump_spec(spec, "dsl")
    from_dsl = geomopt.parse_spec(dsl, "dsl")
    assert from_dsl == spec
    yml = geomopt.dump_spec(from_dsl, "yaml")
    assert geomopt.parse_spec(yml, "yaml") == spec
    assert geomopt.dump_spec(geomopt.parse_spec(yml, "yaml"), "yaml") == yml
    assert geomopt.dump_spec(from_dsl, "dsl") == dsl


def test_python_built_spec_round_trips():
    spec = Spec(geomopt=1, name="p", roles={"norm": ["**.ln_*.weight"], "expert": ["re:.*experts.*"]}, rules=[
        Rule(name="a", match=Match(role="expert"), geometry=Spectral(reference=Indicator(), view=MatrixView(batch=1))),
        Rule(name="b", match=Match(role=["norm", "bias"], module="LayerNorm"), geometry=Euclidean()),
    ])
    for fmt in ("yaml", "dsl"):
        assert geomopt.parse_spec(geomopt.dump_spec(spec, fmt), fmt) == spec


# ---------------------------------------------------------------- JSON Schema


def test_schema_accepts_view_shorthand_and_role_lists():
    data = parse_yaml(YAML).data
    sch = schema()
    try:
        import jsonschema
    except ImportError:  # not a dependency: check the structure the validator would use
        jsonschema = None
    if jsonschema is None:
        defs = sch["$defs"]
        view = defs["Spectral"]["properties"]["view"]["anyOf"]
        assert {"type": "string", "enum": list(VIEW_KINDS)}.items() <= view[0].items()
        role = defs["Match"]["properties"]["role"]["anyOf"]
        assert any(s.get("type") == "array" and set(s["items"]["enum"]) == set(ROLE_NAMES) for s in role)
        assert set(sch["properties"]["roles"]["propertyNames"]["enum"]) == set(ROLE_NAMES)
        return
    validator = jsonschema.Draft202012Validator(sch)
    assert not [e.message for e in validator.iter_errors(data)]
    # and not vacuously: a misspelled view kind, an unknown role, a bad view field are rejected
    for path, bad in [
        (("rules", 0, "geometry", "view"), "atuo"),
        (("rules", 0, "match", "role"), ["hidden", "hedd"]),
        (("rules", 1, "geometry", "view", "blocks"), 0),
        (("rules", 1, "geometry", "view", "trailing"), "col"),
    ]:
        broken = json.loads(json.dumps(data))
        node = broken
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = bad
        assert list(validator.iter_errors(broken)), (path, bad)
    broken = json.loads(json.dumps(data))
    broken["roles"]["hedd"] = ["x"]
    assert list(validator.iter_errors(broken))


# ---------------------------------------------------------------- positions and errors


def test_dsl_positions_of_roles_and_views():
    source = parse_dsl(DSL).source
    assert source.pos(("roles",), key=True) == (3, 1)
    assert source.pos(("roles", "head"), key=True) == (3, 7)
    assert source.pos(("roles", "head", 1)) == (3, 42)
    assert source.pos(("roles", "router", 0)) == (3, 63)
    assert source.pos(("rules", 0, "match", "role", 1)) == (4, 33)
    assert source.pos(("rules", 0, "geometry", "view")) == (5, 61)
    assert source.pos(("rules", 0, "geometry", "view", "kind")) == (5, 61)
    assert source.pos(("rules", 1, "geometry", "view", "blocks", 2)) == (7, 86)


@pytest.mark.parametrize("fmt, old, new, code, pos, hints", [
    ("yaml", "role: [hidden, expert]", "role: [hidden, exprt]", "GO005", (8, 28), ["unknown role 'exprt'", "did you mean 'expert'", "embedding, head"]),
    ("yaml", "role: head}", "role: hedd}", "GO005", (18, 19), ["rules[2].match.role", "unknown role 'hedd'"]),
    ("yaml", "  router:", "  routr:", "GO005", (5, 3), ["roles: unknown role 'routr'", "did you mean 'router'"]),
    ("yaml", "blocks: 4", "blocks: 0", "GO005", (19, 94), ["view.blocks", "greater than or equal to 1"]),
    ("yaml", "view: auto", "view: atuo", "GO004", (13, 13), ["unknown view kind 'atuo'", "did you mean 'auto'"]),
    ("yaml", "batch: 1,", "batch: -1,", "GO005", (16, 89), ["view.batch", "greater than or equal to 0"]),
    ("yaml", "fc.weight]", "'re:fc(']", "GO007", (4, 37), ["roles: bad regular expression"]),
    ("dsl", "role=[hidden, expert]", "role=[hidden, exprt]", "GO005", (4, 33), ["unknown role 'exprt'", "did you mean 'expert'", "embedding, head"]),
    ("dsl", "role=head", "role=hedd", "GO005", (8, 23), ["rules[2].match.role", "unknown role 'hedd'"]),
    ("dsl", "router=", "routr=", "GO005", (3, 55), ["roles: unknown role 'routr'"]),
    ("dsl", "blocks=4", "blocks=0", "GO005", (9, 56), ["view.blocks", "greater than or equal to 1"]),
    ("dsl", "view=auto", "view=atuo", "GO004", (5, 61), ["unknown view kind 'atuo'", "did you mean 'auto'"]),
    ("dsl", "blocks=[64, 32, 32]", "blocks=[64, 0, 32]", "GO005", (7, 82), ["view.blocks[1]"]),
    ("dsl", "view=matrix)", "view=matrix(blocks=[]))", "GO005", (11, 55), ["view.blocks", "at least 1 item"]),
    ("dsl", '"fc.weight"', '"re:fc("', "GO007", (3, 42), ["roles: bad regular expression"]),
])
def test_error_positions(fmt, old, new, code, pos, hints):
    text = YAML if fmt == "yaml" else DSL
    assert old in text
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec(text.replace(old, new, 1), fmt, file="s")
    d = info.value.diagnostics[0]
    assert (d.code, (d.line, d.col)) == (code, pos), d.format()
    for hint in hints:
        assert hint in d.message, (hint, d.message)


def test_view_only_on_matrix_geometries():
    for fmt, text in [
        ("yaml", "geomopt: 1\nname: x\nrules:\n  - {name: a, match: '**', geometry: {kind: isotropic, reference: {kind: indicator}, view: auto}}\n"),
        ("dsl", 'geomopt 1\nname "x"\nrule a match "**":\n    geometry isotropic(indicator, view=auto)\n'),
    ]:
        with pytest.raises(geomopt.SpecError) as info:
            geomopt.parse_spec(text, fmt)
        d = info.value.diagnostics[0]
        assert d.code == "GO003" and "unknown field 'view'" in d.message


# ---------------------------------------------------------------- shipped specs


@pytest.mark.parametrize("stem", ["muon", "prox-muon-frobenius", "uscion"])
def test_shipped_geom_twins_route_by_role(stem):
    """The hand-written .geom files equal their .yaml twins, roles and auto views included."""
    geom = geomopt.load_spec(ROOT / "specs" / f"{stem}.geom")
    assert geom == geomopt.load_spec(ROOT / "specs" / f"{stem}.yaml")
    hidden = next(r for r in geom.rules if r.name == "hidden")
    assert hidden.match.role == ["hidden", "expert"] and hidden.geometry.view == AutoView()
