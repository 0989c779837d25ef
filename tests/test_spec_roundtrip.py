"""YAML and the DSL are two spellings of one model: parse(dump(s)) == s, both ways.

Shipped specs are checked in every direction; hypothesis generates valid Spec objects with every
kind of geometry, reference, approximation, view, constraint, direction and schedule, match roles
and spec-level roles, and with the strings that trip printers (unicode, quotes, backslashes, "1e-3", "yes", "10:30", keywords).
The committed JSON Schema is checked against the models and against the shipped specs.
"""

from __future__ import annotations

import json
import pathlib

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomopt
from geomopt.spec.geometries import (
    AolPrenorm,
    FrobeniusPrenorm,
    NoPrenorm,
    POLYNOMIAL_APPROX_KINDS,
    Spectral,
    Adam,
    Kronecker,
    Anisotropic,
    AutoView,
    Columnwise,
    Euclidean,
    GEOMETRY_KINDS,
    GramEigh,
    Indicator,
    Isotropic,
    LogBarrier,
    MatrixView,
    MaxPrenorm,
    NewtonSchulz,
    PolarExpress,
    PowerBarrier,
    Quadratic,
    Rowwise,
    Svd,
    VIEW_KINDS,
)
from geomopt.spec.constraints import (
    CONSTRAINT_KINDS,
    FrobeniusBall,
    FrobeniusSphere,
    L0,
    L2Ball,
    LinfBall,
    LinfSphere,
    ProximalDecay,
    Rank,
    SignSet,
    SpectralBall,
    SpectralSphere,
    Stiefel,
)
from geomopt.spec.model import ROLE_NAMES, Defaults, Match, Rule, Spec
from geomopt.spec.updates import (
    DIRECTION_KINDS,
    MaxLogitClip,
    Polyak,
    Storm,
    StormSchedule,
    TheorySchedule,
    ConstantSchedule,
    Dion,
    NoDirection,
    STAGE_ORDER,
)
from geomopt.spec.patterns import pattern_error
from geomopt.spec.schema import SCHEMA_PATH, schema_text
from geomopt.spec.yaml_front import parse_yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "specs").glob("*.yaml"))
SHIPPED_DSL = sorted((ROOT / "specs").glob("*.geom"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_there_are_shipped_specs():
    assert len(SHIPPED) >= 5


# ---------------------------------------------------------------- shipped specs


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_yaml_dsl_yaml(path):
    spec = geomopt.load_spec(path)
    dsl = geomopt.dump_spec(spec, "dsl")
    from_dsl = geomopt.parse_spec(dsl, "dsl")
    assert from_dsl == spec
    yaml_text = geomopt.dump_spec(from_dsl, "yaml")
    assert geomopt.parse_spec(yaml_text, "yaml") == spec
    # printing is a fixed point: the printed forms print the same again
    assert geomopt.dump_spec(from_dsl, "dsl") == dsl
    assert geomopt.dump_spec(geomopt.parse_spec(yaml_text, "yaml"), "yaml") == yaml_text


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_dsl_text_to_yaml(path, tmp_path):
    """A .geom file on disk (the DSL text) converts to YAML and back to the same spec."""
    spec = geomopt.load_spec(path)
    geom = tmp_path / f"{path.stem}.geom"
    geom.write_text(geomopt.dump_spec(spec, "dsl"), encoding="utf-8")
    from_file = geomopt.load_spec(geom)
    assert from_file == spec
    yml = tmp_path / f"{path.stem}.yaml"
    yml.write_text(geomopt.dump_spec(from_file, "yaml"), encoding="utf-8")
    assert geomopt.load_spec(yml) == spec


@pytest.mark.parametrize("path", SHIPPED_DSL, ids=[p.stem for p in SHIPPED_DSL])
def test_shipped_geom_files(path):
    """A shipped .geom (hand-written DSL text) → YAML → DSL gives the same spec, equal to its .yaml twin."""
    spec = geomopt.load_spec(path)
    yaml_text = geomopt.dump_spec(spec, "yaml")
    from_yaml = geomopt.parse_spec(yaml_text, "yaml")
    assert from_yaml == spec
    assert geomopt.parse_spec(geomopt.dump_spec(from_yaml, "dsl"), "dsl") == spec
    twin = path.with_suffix(".yaml")
    if twin.exists():
        assert geomopt.load_spec(twin) == spec


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_printed_dsl_is_compact(path):
    """Defaults are left out and kinds print bare where nothing else is set."""
    dsl = geomopt.dump_spec(geomopt.load_spec(path), "dsl")
    assert dsl.startswith("geomopt 1\n")
    assert "kind=" not in dsl and "radius=1.0," not in dsl and "(reference=" not in dsl


# ---------------------------------------------------------------- strategies for valid specs

TRICKY = [
    "1e-3", "1.0e-3", ".5", "-1", "+1", "0o17", "0x1F", "10:30", "1_000", "yes", "no", "on", "off", "y", "n",
    "true", "False", "null", "~", "", " ", "-", "*", "**", "a: b", "- x", "#c", "x #c", "'", '"', "\\", "\\n",
    "é", "名前", "🙂", "tab\there", "line\nbreak", "\u2028", "\x85", "NaN", ".inf", "geometry", "rule", "match", "roles",
    "name", "lr", "kind", "none", "[1]", "{a}", "&a", "*a", "!tag", "%", "@", "`", "a\\\"b", "re:", "  lead", "trail  ",
]
text = st.one_of(st.sampled_from(TRICKY), st.text(max_size=12))
nonempty = text.filter(bool)
pos = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)
nonneg = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
prob = st.floats(min_value=0, max_value=1, exclude_min=True, allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False)
dtype = st.sampled_from(["auto", "float32", "bfloat16", "float64"])
scale = st.sampled_from(["none", "scion", "muon_original", "match_rms_adamw"])
layout = st.sampled_from(["auto", "out_in", "in_out"])
rule_name = st.one_of(
    st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_\-]{0,10}\Z"),
    st.sampled_from(["match", "rule", "roles", "geometry", "true", "false", "lr", "name", "geomopt", "a-b", "_"]),
)


def _compiles(p: str) -> bool:
    """A regex the matcher runs (Python's syntax, less what RE2 lacks: geomopt.spec.patterns)."""
    return pattern_error("re:" + p) is None


pattern = st.one_of(
    nonempty.filter(lambda s: not s.startswith("re:")),
    st.sampled_from(["re:.*", r"re:(lm_)?head\.weight", r"re:.*\.(h|layers)\..*\.weight", "re:a|b", r"re:\d+"]),
    text.filter(_compiles).map(lambda s: "re:" + s),
)


def model(cls, **fields):
    """``cls`` built from a random subset of ``fields`` (the rest keep their defaults)."""
    required = {k: v for k, v in fields.items() if cls.model_fields[k].is_required()}
    optional = {k: v for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda d: _build(cls, d)).filter(
        lambda m: m is not None)


def _build(cls, d: dict):
    """``cls(**d)``, or None for a combination the model refuses (a polynomial approx without
    pre-normalization, geomopt.spec.geometries)."""
    try:
        return cls(**d)
    except pydantic.ValidationError:
        return None


reference = st.one_of(
    model(LogBarrier, eps=pos),
    model(PowerBarrier, kappa=st.floats(min_value=1, allow_nan=False, allow_infinity=False), eps=pos),
    st.just(Indicator()),
    st.just(Quadratic()),
)
triple = st.lists(finite, min_size=3, max_size=3)


@st.composite
def newton_schulz(draw):
    steps = draw(st.integers(1, 100))
    per_step = st.lists(triple, min_size=steps, max_size=steps) if steps <= 6 else st.none()
    named = st.sampled_from(["simple", "quintic", "polar_express", "cans", "aol"])
    coefficients = draw(st.one_of(st.none(), st.lists(triple, min_size=1, max_size=1), per_step, named))
    return NewtonSchulz(steps=steps, coefficients=coefficients, dtype=draw(dtype))


approx = st.one_of(
    model(Svd, dtype=dtype),
    model(GramEigh, dtype=dtype),
    newton_schulz(),
    model(PolarExpress, steps=st.integers(1, 100), dtype=dtype,
          coefficients=st.one_of(st.sampled_from(["polar_express", "speedrun"]), st.lists(triple, min_size=1, max_size=4))),
)
prenormalize = st.one_of(model(FrobeniusPrenorm, eps=pos), model(MaxPrenorm, eps=pos), model(AolPrenorm, eps=pos),
                         st.just(NoPrenorm()))
# none, auto (printed as the shorthand), or a matrix view with blocks a count or a list of sizes
view = st.one_of(
    st.none(),
    st.just(AutoView()),
    model(MatrixView, batch=st.integers(0, 4), trailing=st.sampled_from(["cols", "batch"]),
          blocks=st.one_of(st.none(), st.integers(1, 64), st.lists(st.integers(1, 4096), min_size=1, max_size=4))),
)
geometry = st.one_of(
    model(Euclidean, radius=pos),
    model(Isotropic, radius=pos, reference=reference, scale=scale),
    model(Anisotropic, radius=pos, reference=reference, scale=scale, layout=layout, view=view),
    approx.flatmap(lambda a: model(  # a polynomial iteration needs pre-normalization (Spectral refuses none)
        Spectral, radius=pos, reference=reference, approx=st.just(a), scale=scale, layout=layout, view=view,
        prenormalize=prenormalize.filter(lambda p: not isinstance(p, NoPrenorm))
        if a.kind in POLYNOMIAL_APPROX_KINDS
        else prenormalize.filter(lambda p: not isinstance(p, AolPrenorm)))),  # aol: the iterations only
    model(Rowwise, radius=pos, reference=reference, scale=scale, layout=layout, view=view),
    model(Columnwise, radius=pos, reference=reference, scale=scale, layout=layout, view=view),
    model(Adam, radius=pos, eps=pos,
          betas=st.lists(st.floats(min_value=0, max_value=1, exclude_max=True, allow_nan=False), min_size=2, max_size=2)),
    model(Kronecker, radius=pos, method=st.sampled_from(["shampoo", "soap", "psgd"]), every=st.integers(1, 10**6),
          max_dim=st.one_of(st.none(), st.integers(1, 10**6)), layout=layout,
          view=view,
          graft=st.sampled_from(["none", "adagrad", "adam", "spectral"]),
          momentum=st.floats(min_value=0, max_value=1, exclude_max=True, allow_nan=False),
          precond_lr=st.floats(min_value=0, max_value=1, exclude_min=True, allow_nan=False)),
)
method = st.sampled_from(["auto", "exact", "polar"])
radius_fields = dict(radius=pos, relative=st.booleans())
constraint = st.one_of(
    *[model(cls, **radius_fields) for cls in (L2Ball, LinfBall, LinfSphere, SignSet, FrobeniusBall, SpectralSphere)],
    model(FrobeniusSphere, method=st.sampled_from(["prox", "project"]), **radius_fields),
    model(SpectralBall, method=method, **radius_fields),
    model(Stiefel, method=method, **radius_fields),
    model(L0, k=st.integers(1, 10**12)),
    model(Rank, k=st.integers(1, 10**6)),
    model(ProximalDecay, lam=pos),
)
direction = st.one_of(
    st.just(NoDirection()),
    model(Polyak, alpha=prob, nesterov=st.booleans(), init=st.sampled_from(["zero", "gradient"])),
    model(Storm, alpha=prob),
    model(Dion, rank=st.one_of(st.integers(1, 10**6), prob), mu=st.floats(0, 1, exclude_max=True), eps=pos),
)
schedule = st.one_of(
    st.just(ConstantSchedule()), st.just(StormSchedule()),
    model(TheorySchedule, horizon=st.integers(1, 10**9), gamma_bar=pos),
)
ndim = st.one_of(st.integers(0, 8), st.lists(st.integers(0, 8), min_size=1, max_size=4))
shape = st.lists(st.one_of(st.integers(0, 4096), st.just("*")), max_size=4)
role_name = st.sampled_from(ROLE_NAMES)
role = st.one_of(role_name, st.lists(role_name, min_size=1, max_size=4))
match = st.fixed_dictionaries({}, optional=dict(name=pattern, module=nonempty, role=role, ndim=ndim, shape=shape)).flatmap(
    lambda d: st.just(Match(**d)) if d else pattern.map(lambda p: Match(name=p)))  # at least one predicate
roles = st.dictionaries(role_name, st.lists(pattern, min_size=1, max_size=3), max_size=3)
hyper = dict(lr=nonneg, weight_decay=nonneg, direction=direction, schedule=schedule,
             on_nonfinite=st.sampled_from(["skip", "raise", "off"]), project_on_init=st.booleans())
qk_clip = model(MaxLogitClip, tau=pos, alpha=st.floats(min_value=0, max_value=1, allow_nan=False))
rule = model(Rule, name=rule_name, match=match, geometry=geometry, constraint=constraint, qk_clip=qk_clip, **hyper)


@st.composite
def specs(draw):
    rules = draw(st.lists(rule, min_size=1, max_size=4, unique_by=lambda r: r.name))
    fields = draw(st.fixed_dictionaries({}, optional={"description": text, "defaults": model(Defaults, **hyper), "roles": roles}))
    return Spec(geomopt=1, name=draw(nonempty), rules=rules, **fields)


# ---------------------------------------------------------------- generated round trips


@SETTINGS
@given(specs())
def test_roundtrip_yaml(spec):
    text = geomopt.dump_spec(spec, "yaml")
    assert geomopt.parse_spec(text, "yaml") == spec, text


@SETTINGS
@given(specs())
def test_roundtrip_dsl(spec):
    text = geomopt.dump_spec(spec, "dsl")
    assert geomopt.parse_spec(text, "dsl") == spec, text


@SETTINGS
@given(specs())
def test_roundtrip_across_formats(spec):
    """yaml → dsl → yaml and dsl → yaml → dsl give the same spec and the same text."""
    via_dsl = geomopt.parse_spec(geomopt.dump_spec(spec, "dsl"), "dsl")
    yaml_text = geomopt.dump_spec(via_dsl, "yaml")
    assert geomopt.parse_spec(yaml_text, "yaml") == spec
    assert yaml_text == geomopt.dump_spec(spec, "yaml")
    via_yaml = geomopt.parse_spec(geomopt.dump_spec(spec, "yaml"), "yaml")
    assert geomopt.dump_spec(via_yaml, "dsl") == geomopt.dump_spec(spec, "dsl")


@SETTINGS
@given(specs())
def test_plain_data_roundtrip(spec):
    """model_dump() → Spec.model_validate gives the spec back (the dict form GeomOptimizer accepts)."""
    assert Spec.model_validate(spec.model_dump()) == spec


def test_tricky_strings_are_quoted():
    """Strings that YAML 1.1/1.2 or the DSL would read as something else print quoted."""
    spec = Spec(geomopt=1, name="yes", description="1e-3", rules=[
        Rule(name="true", match=Match(name="10:30", module="null"), geometry=Euclidean()),
        Rule(name="lr", match=Match(module="geometry"), geometry=Euclidean()),
    ])
    y = geomopt.dump_spec(spec, "yaml")
    assert 'name: "yes"' in y and 'description: "1e-3"' in y and '"10:30"' in y and 'module: "null"' in y
    assert "- name: \"true\"" in y  # a rule name YAML 1.1 would read as a boolean
    d = geomopt.dump_spec(spec, "dsl")
    assert 'module="null"' not in d  # null is not a DSL word: it may print bare
    assert 'module="geometry"' in d and 'name "yes"' in d
    for fmt, t in (("yaml", y), ("dsl", d)):
        assert geomopt.parse_spec(t, fmt) == spec


# ---------------------------------------------------------------- JSON Schema


def test_committed_schema_is_current():
    assert (ROOT / SCHEMA_PATH).read_text(encoding="utf-8") == schema_text()


def _shipped_data():
    return [(p, parse_yaml(p.read_text(encoding="utf-8"), str(p)).data) for p in SHIPPED]


def test_schema_has_the_discriminated_kinds():
    """Structural check (runs with or without jsonschema): each kind field is a discriminated union
    whose mapping lists exactly the model's kinds."""
    schema = json.loads(schema_text())
    defs = schema["$defs"]
    expected = {
        ("Rule", "geometry"): set(GEOMETRY_KINDS),
        ("Rule", "constraint"): set(CONSTRAINT_KINDS),
        ("Spectral", "reference"): {"log_barrier", "power_barrier", "indicator", "quadratic"},
        ("Spectral", "approx"): {"svd", "gram_eigh", "newton_schulz", "gram_newton_schulz", "polar_express"},
        ("Spectral", "prenormalize"): {"frobenius", "max", "aol", "none"},
        ("Rule", "direction"): set(DIRECTION_KINDS),
        ("Rule", "decay"): {"decoupled", "cautious"},
        ("Defaults", "schedule"): {"constant", "theory", "storm"},
        **{(owner, "view"): set(VIEW_KINDS)
           for owner in ("Anisotropic", "Spectral", "Rowwise", "Columnwise", "Kronecker")},
    }
    for (owner, field), kinds in expected.items():
        prop = defs[owner]["properties"][field]
        union = next(s for s in [prop, *prop.get("anyOf", [])] if "discriminator" in s)
        assert union["discriminator"]["propertyName"] == "kind"
        mapping = union["discriminator"]["mapping"]
        assert set(mapping) == kinds, (owner, field)
        for kind, ref in mapping.items():
            target = defs[ref.rsplit("/", 1)[-1]]
            assert target["properties"]["kind"]["const"] == kind
            assert target.get("additionalProperties") is False
    post = next(s for s in defs["Rule"]["properties"]["post"]["anyOf"] if s.get("type") == "array")
    assert set(post["items"]["discriminator"]["mapping"]) == set(STAGE_ORDER)
    assert schema["properties"]["geomopt"]["const"] == 1
    assert set(schema["required"]) == {"geomopt", "name"}  # and rules, unless it extends (geomopt.spec.extends)
    assert schema["if"]["required"] == ["extends"] and schema["else"]["required"] == ["rules"]
    match = defs["Rule"]["properties"]["match"]["anyOf"]
    assert any(s.get("type") == "string" for s in match) and any(s.get("$ref") == "#/$defs/Match" for s in match)
    # `view: auto` is shorthand for `view: {kind: auto}` on every geometry that has a view
    with_view = {name for name, d in defs.items() if "view" in d.get("properties", {})}
    assert with_view == {"Anisotropic", "Spectral", "Rowwise", "Columnwise", "Kronecker"}
    for name in with_view:
        shorthand = [s for s in defs[name]["properties"]["view"]["anyOf"] if s.get("type") == "string"]
        assert shorthand and set(shorthand[0]["enum"]) == set(VIEW_KINDS), name
    # the structure the shipped specs use is allowed by it
    for path, data in _shipped_data():
        for rule in data["rules"]:
            assert set(rule) <= set(defs["Rule"]["properties"]), path
            assert rule["geometry"]["kind"] in defs["Rule"]["properties"]["geometry"]["discriminator"]["mapping"]


def test_shipped_specs_validate_against_schema():
    try:
        import jsonschema
    except ImportError:  # not a dependency: the structural test above covers the schema then
        jsonschema = None
    schema = json.loads(schema_text())
    if jsonschema is None:
        for path, data in _shipped_data():
            assert set(data) <= set(schema["properties"]), path
            assert data["geomopt"] == schema["properties"]["geomopt"]["const"]
        return
    validator = jsonschema.Draft202012Validator(schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    for path, data in _shipped_data():
        errors = [e.message for e in validator.iter_errors(data)]
        assert not errors, (path, errors)
    # and it is not vacuous: a typo'd kind and an unknown field are rejected
    path, data = _shipped_data()[0]
    bad = json.loads(json.dumps(data))
    bad["rules"][0]["geometry"]["kind"] = "spectrl"
    assert list(validator.iter_errors(bad))
    bad = json.loads(json.dumps(data))
    bad["rules"][0]["lrr"] = 0.1
    assert list(validator.iter_errors(bad))
