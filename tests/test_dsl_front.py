"""The DSL front end: every spelling the grammar allows maps to the same data as YAML, errors name
what was expected, and positions point at the offending token."""

from __future__ import annotations

import pytest

import geomopt
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.dsl_front import parse_dsl

HEAD = 'geomopt 1\nname "x"\n'


def rule_data(body: str, head: str = 'rule a match "**":\n'):
    """The first rule of HEAD + head + body, as plain data."""
    return parse_dsl(HEAD + head + body).data["rules"][0]


# (rule body in the DSL, the rule's fields as YAML would give them)
SPELLINGS = [
    # bare kinds and calls
    ("geometry euclidean", {"geometry": {"kind": "euclidean"}}),
    ("geometry euclidean()", {"geometry": {"kind": "euclidean"}}),
    ("geometry=euclidean", {"geometry": {"kind": "euclidean"}}),
    ("geometry adam(betas=[0.9, 0.95])", {"geometry": {"kind": "adam", "betas": [0.9, 0.95]}}),
    ("constraint rank(k=2)\ngeometry euclidean", {"constraint": {"kind": "rank", "k": 2}, "geometry": {"kind": "euclidean"}}),
    # positional reference, or named
    ("geometry spectral(indicator)", {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}}}),
    ("geometry spectral(indicator())", {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}}}),
    ("geometry spectral(reference=indicator)", {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}}}),
    ("geometry spectral(log_barrier(eps=1e-8), approx=svd, prenormalize=max(eps=1e-7))",
     {"geometry": {"kind": "spectral", "reference": {"kind": "log_barrier", "eps": 1e-8}, "approx": {"kind": "svd"},
                   "prenormalize": {"kind": "max", "eps": 1e-7}}}),
    # `key value` and `key=value`, settings in any order
    ("geometry euclidean\nlr 0.1\nweight_decay=0", {"geometry": {"kind": "euclidean"}, "lr": 0.1, "weight_decay": 0}),
    ("lr=0.1 geometry euclidean direction=none", {"lr": 0.1, "geometry": {"kind": "euclidean"}, "direction": {"kind": "none"}}),
    ("geometry euclidean direction polyak(alpha=0.05, nesterov=true, init=gradient)",
     {"geometry": {"kind": "euclidean"}, "direction": {"kind": "polyak", "alpha": 0.05, "nesterov": True, "init": "gradient"}}),
    ("geometry euclidean schedule=theory(horizon=100, gamma_bar=0.5) on_nonfinite=raise project_on_init=false",
     {"geometry": {"kind": "euclidean"}, "schedule": {"kind": "theory", "horizon": 100, "gamma_bar": 0.5},
      "on_nonfinite": "raise", "project_on_init": False}),
    ("geometry adam on_nonfinite off", {"geometry": {"kind": "adam"}, "on_nonfinite": "off"}),
    # comments, free layout, trailing commas
    ("geometry spectral(  # the reference comes first\n    indicator,   # comment\n    approx = svd ,\n)  # done",
     {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}}),
    # numbers: negative, signed, exponent, leading/trailing dot; ints stay ints
    ("geometry spectral(indicator, approx=newton_schulz(steps=1, coefficients=[[3.4445, -4.7750, 2.0315],]))",
     {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"},
                   "approx": {"kind": "newton_schulz", "steps": 1, "coefficients": [[3.4445, -4.775, 2.0315]]}}}),
    ("geometry euclidean(radius=+2.) lr=.5 weight_decay=1E-2", {"geometry": {"kind": "euclidean", "radius": 2.0}, "lr": 0.5, "weight_decay": 0.01}),
    # views: a bare word names the kind, a call gives its fields
    ("geometry spectral(indicator, approx=newton_schulz, view=auto)",
     {"geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}, "view": {"kind": "auto"}}}),
    ("geometry rowwise(indicator, view=matrix(batch=1, trailing=batch, blocks=[64, 32, 32]))",
     {"geometry": {"kind": "rowwise", "reference": {"kind": "indicator"},
                   "view": {"kind": "matrix", "batch": 1, "trailing": "batch", "blocks": [64, 32, 32]}}}),
    ("geometry anisotropic(indicator, view=matrix(blocks=3))",
     {"geometry": {"kind": "anisotropic", "reference": {"kind": "indicator"}, "view": {"kind": "matrix", "blocks": 3}}}),
]


@pytest.mark.parametrize("body, expected", SPELLINGS, ids=[s[0][:40] for s in SPELLINGS])
def test_spellings(body, expected):
    data = rule_data(body)
    assert {k: v for k, v in data.items() if k not in ("name", "match")} == expected
    assert all(type(data[k]) is type(v) for k, v in expected.items() if not isinstance(v, (dict, list)))
    geomopt.parse_spec(HEAD + 'rule a match "**":\n' + body, "dsl")  # and it validates


@pytest.mark.parametrize("head, match", [
    ('rule a match "**":', {"name": "**"}),
    ('rule a match name="**":', {"name": "**"}),
    ("rule a match module=Embedding:", {"module": "Embedding"}),
    ('rule a match "re:.*\\\\.weight" ndim=2:', {"name": "re:.*\\.weight", "ndim": 2}),
    ('rule a match module=Linear ndim=[2, 3] shape=["*", 768]:', {"module": "Linear", "ndim": [2, 3], "shape": ["*", 768]}),
    # roles are bare words (a string where no kind is expected)
    ("rule a match role=hidden:", {"role": "hidden"}),
    ("rule a match role=[hidden, expert] ndim=2:", {"role": ["hidden", "expert"], "ndim": 2}),
    ('rule a match role="head" name="**.weight":', {"role": "head", "name": "**.weight"}),
])
def test_match_spellings(head, match):
    assert rule_data("geometry euclidean\n", head + "\n")["match"] == match


@pytest.mark.parametrize("literal, value", [
    (r'"plain"', "plain"), (r'"a\"b"', 'a"b'), (r'"back\\slash"', "back\\slash"), (r'"\u00e9"', "é"),
    (r'"\ud83d\ude42"', "🙂"), ('"名前 🙂"', "名前 🙂"), (r'"line\nbreak"', "line\nbreak"), (r'"tab\t"', "tab\t"),
    (r'"1e-3"', "1e-3"), (r'"yes"', "yes"), (r'"geometry"', "geometry"), (r'""', ""), ("\"it's\"", "it's"),
])
def test_string_escapes(literal, value):
    assert parse_dsl(f"geomopt 1\nname {literal}\n").data["name"] == value


def test_keywords_as_names():
    """Rule names and field names may be keywords; a misspelled keyword is still lexed whole."""
    text = HEAD + 'rule match match name="**":\n    geometry euclidean\nrule rule match "x":\n    geometry euclidean\n'
    spec = geomopt.parse_spec(text, "dsl")
    assert [r.name for r in spec.rules] == ["match", "rule"]
    assert geomopt.parse_spec(geomopt.dump_spec(spec, "dsl"), "dsl") == spec


@pytest.mark.parametrize("statement, roles", [
    ('roles head=["re:.*\\\\.proj_out\\\\.weight", "fc.weight"] router=["**.gate.weight"]',
     {"head": ["re:.*\\.proj_out\\.weight", "fc.weight"], "router": ["**.gate.weight"]}),
    ('roles\n    head=["lm_head.weight"]\n    norm=["**.ln_*.weight", "**.ln_*.bias",]', {"head": ["lm_head.weight"], "norm": ["**.ln_*.weight", "**.ln_*.bias"]}),
    ("roles", {}),
])
def test_roles_statement(statement, roles):
    """`roles role=[patterns…]` is the spec's roles mapping, wherever it stands among the statements."""
    for text in (HEAD + statement + '\nrule a match "**":\n    geometry euclidean\n',
                 HEAD + 'rule a match "**":\n    geometry euclidean\n' + statement + "\n"):
        assert parse_dsl(text).data["roles"] == roles
        assert geomopt.parse_spec(text, "dsl").roles == roles


def test_roles_is_still_a_field_name():
    """`roles` is a keyword only as a statement: as a match field it is a (misspelled) field."""
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(HEAD + 'rule a match roles=hidden:\n    geometry euclidean\n', "dsl")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO003", 3, 14) and "did you mean 'role'" in d.message


def test_whole_spec_on_one_line_equals_yaml():
    dsl = 'geomopt 1 name "demo" defaults lr=0.02 direction=polyak(alpha=0.1) rule hidden match "**.weight" ndim=2: geometry spectral(indicator, approx=newton_schulz) constraint stiefel(relative=true) rule rest match "**": geometry adam'
    yml = """
geomopt: 1
name: demo
defaults: {lr: 0.02, direction: {kind: polyak, alpha: 0.1}}
rules:
  - {name: hidden, match: {name: "**.weight", ndim: 2},
     geometry: {kind: spectral, reference: {kind: indicator}, approx: {kind: newton_schulz}},
     constraint: {kind: stiefel, relative: true}}
  - {name: rest, match: "**", geometry: {kind: adam}}
"""
    assert geomopt.parse_spec(dsl, "dsl") == geomopt.parse_spec(yml, "yaml")


# ---------------------------------------------------------------- errors name what was expected

ERRORS = [
    # (text after HEAD, code, line, col, substrings)
    ('rule a match "**":\n    foo euclidean\n', "GO001", 4, 5,
     ["unexpected token 'foo'", "expected one of constraint, decay, defaults, description, direction", "geometry", "lr", "rule"]),
    ('rule a match "**":\n    geometyr euclidean\n', "GO001", 4, 5, ["did you mean 'geometry'"]),
    ('rule a match "**":\n    geometry euclidean\n    constrant l0(k=1)\n', "GO001", 5, 5, ["did you mean 'constraint'"]),
    ('rule a match "**":\n    geometry euclidean\n    lrr=1\n', "GO001", 5, 5, ["'lrr'", "did you mean 'lr'"]),
    ('defaults weight_decai=0.1\n', "GO001", 3, 10, ["did you mean 'weight_decay'"]),
    ('rulez a match "**":\n', "GO001", 3, 1, ["did you mean 'rule'", "expected one of defaults, description, end of input, name, roles, rule"]),
    ('rolse head=["x"]\n', "GO001", 3, 1, ["did you mean 'roles'"]),
    ('roles head ["x"]\n', "GO001", 3, 12, ["unexpected token '['", "'='"]),
    ('roles head=["x"]\nrule a match role=hedd:\n    geometry euclidean\n', "GO005", 4, 19,
     ["unknown role 'hedd'", "did you mean 'head'", "embedding, head, router"]),
    ('rule a match "**":\n    geometry spectral(indicator, view=matrix(blocks=[64, 0]))\n', "GO005", 4, 58,
     ["view.blocks[1]", "greater than or equal to 1"]),
    ('rule a "**":\n', "GO001", 3, 8, ["expected one of match"]),
    ('rule a match "**" geometry euclidean\n', "GO001", 3, 19, ["expected ':' before 'geometry'"]),
    ('rule a match "**":\n    geometry spectral(indicator\n', "GO001", 5, 1, ["end of input", "')'", "','"]),
    ('rule a match "**":\n    geometry spectral(indicator,, approx=svd)\n', "GO001", 4, 33, ["unexpected token ','"]),
    ('rule a match "**":\n    geometry spectral(indicator) lr=\n', "GO001", 5, 1, ["end of input", "a number"]),
    ('rule a match "**":\n    geometry euclidean\n    lr=0.1.2\n', "GO001", 5, 11, ["'.2'"]),
    ('rule a match "**":\n    geometry euclidean $\n', "GO001", 4, 24, ["unexpected character '$'"]),
    ('rule a match "**":\n    geometry "euclidean\n', "GO001", 4, 14, ["unterminated string"]),
    ('rule a match "**":\n    geometry spectral(indicator, approx=svd, indicator)\n', "GO005", 4, 46,
     ["positional argument not allowed here", "its reference, first"]),
    ('rule a match "**":\n    geometry spectral(indicator, quadratic)\n', "GO005", 4, 34, ["positional argument not allowed here"]),
    ('rule a match "**":\n    geometry euclidean\n    direction=storm(0.5)\n', "GO005", 5, 21, ["positional argument"]),
    ('rule a match "**":\n    geometry spectral(kind=indicator)\n', "GO005", 4, 23, ["'kind' is the call's name"]),
    ('rule a match "**":\n    geometry euclidean\n    lr=1\n    lr=2\n', "GO002", 6, 5, ["duplicate key 'lr'", "line 5, column 5"]),
    ('rule a match "**":\n    geometry spectral(indicator, approx=svd(dtype=float16))\n', "GO005", 4, 51,
     ["'auto', 'float32', 'bfloat16' or 'float64'", "got 'float16'", "did you mean"]),
]


@pytest.mark.parametrize("text, code, line, col, hints", ERRORS, ids=[e[0][:45] for e in ERRORS])
def test_errors(text, code, line, col, hints):
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(HEAD + text, "dsl", file="t.geom")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col, d.file) == (code, line, col, "t.geom"), d.format()
    for hint in hints:
        assert hint in d.message, (hint, d.message)
    assert "__ANON" not in d.message and "$END" not in d.message


@pytest.mark.parametrize("text, expected", [
    ("", "GO009"), ("   \n\n", "GO009"), ("# c\n  # d\n", "GO009"),
    ("name \"x\"\n", "GO001"), ("geomopt\n", "GO001"), ("geomopt one\n", "GO001"), ("geomopt 2\n", "GO008"),
    ("geomopt 1\n", "GO006"), ('geomopt 1\nname "x"\n', "GO006"),
])
def test_header(text, expected):
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(text, "dsl")
    assert info.value.diagnostics[0].code == expected


def test_version_message_uses_dsl_spelling():
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec("geomopt 7\n", "dsl")
    d = info.value.diagnostics[0]
    assert (d.line, d.col) == (1, 9) and "'geomopt 1'" in d.message and "geomopt:" not in d.message


# ---------------------------------------------------------------- positions

TEXT = '''geomopt 1
name "demo"   # a comment
defaults lr=0.02
  direction=polyak(alpha=0.1)
rule hidden match "**.weight" ndim=[2, 3]:
    geometry spectral(power_barrier(kappa=4), approx=newton_schulz(steps=5))
    constraint frobenius_ball(radius=0.5)
'''


@pytest.mark.parametrize("path, key, pos", [
    (("geomopt",), False, (1, 9)),
    (("geomopt",), True, (1, 1)),
    (("name",), False, (2, 6)),
    (("defaults", "lr"), False, (3, 13)),
    (("defaults", "lr"), True, (3, 10)),
    (("defaults", "direction", "kind"), False, (4, 13)),
    (("defaults", "direction", "alpha"), False, (4, 26)),
    (("rules", 0, "name"), False, (5, 6)),
    (("rules", 0, "match"), False, (5, 13)),
    (("rules", 0, "match", "name"), False, (5, 19)),
    (("rules", 0, "match", "ndim", 1), False, (5, 40)),
    (("rules", 0, "geometry"), True, (6, 5)),
    (("rules", 0, "geometry", "kind"), False, (6, 14)),
    (("rules", 0, "geometry", "reference", "kind"), False, (6, 23)),
    (("rules", 0, "geometry", "reference", "kappa"), False, (6, 43)),
    (("rules", 0, "geometry", "approx", "steps"), False, (6, 74)),
    (("rules", 0, "constraint", "radius"), False, (7, 38)),
    # not in the text: nearest ancestor
    (("rules", 0, "geometry", "approx", "dtype"), False, (6, 54)),
])
def test_positions(path, key, pos):
    source = parse_dsl(TEXT).source
    assert source.format == "dsl"
    assert source.pos(path, key=key) == pos


@pytest.mark.parametrize("old, new, code, pos", [
    ("kappa=4", "kappa=0.5", "GO005", (6, 43)),
    ("steps=5", "steps=0", "GO005", (6, 74)),
    ("steps=5", "stpes=5", "GO003", (6, 68)),
    ("frobenius_ball", "frobenius_bal", "GO004", (7, 16)),
    ("alpha=0.1", "alpha=2", "GO005", (4, 26)),
    ("ndim=[2, 3]", "ndim=[2, -3]", "GO005", (5, 40)),
])
def test_validation_positions(old, new, code, pos):
    assert geomopt.parse_spec(TEXT, "dsl")  # the base text is valid
    with pytest.raises(SpecError) as info:
        geomopt.parse_spec(TEXT.replace(old, new), "dsl")
    d = info.value.diagnostics[0]
    assert (d.code, (d.line, d.col)) == (code, pos), d.format()
