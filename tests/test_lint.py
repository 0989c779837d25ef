"""Lint rules: the rule registry (codes, names, severities, docstrings, `geomopt rule`), the clean
shipped specs, and a few behaviours across rules. Each rule's failing and passing cases are fixture
files beside the rules' tests (tests/lint_fixtures/, checked by test_lint_fixtures.py); a new case
is a new file there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import geomopt
from geomopt.cli.main import main
from geomopt.compile import ParamInfo
from geomopt.lint import lint_spec
from geomopt.compile.compiler import model_params
from geomopt.lint import RULES
from geomopt.models import MODELS
from geomopt.spec.diagnostics import LANGUAGE_CODES

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted([*(ROOT / "specs").glob("*.yaml"), *(ROOT / "specs").glob("*.geom")])  # YAML and DSL

HEAD = "geomopt: 1\nname: t\nrules:\n"  # rules start on line 4; the list itself sits at 4:3


def _ckpt(*rows):
    return lambda: [ParamInfo(name=n, shape=s, modules=None) for n, s in rows]


CKPT = _ckpt(("fc.weight", (4, 3)), ("fc.bias", (4,)))
EUCLID = "{kind: euclidean}"
REST = f'  - {{name: rest, match: "**", geometry: {EUCLID}}}\n'


def _lint(text: str, target, fmt: str = "yaml"):
    spec = geomopt.parse_spec(text, fmt, file="t." + ("yaml" if fmt == "yaml" else "geom"))
    if target is None:
        return lint_spec(spec)
    built = MODELS[target]() if isinstance(target, str) else target()
    if isinstance(built, list):  # a checkpoint's ParamInfos
        return lint_spec(spec, built, from_checkpoint=True)
    return lint_spec(spec, model_params(built)[0])


def test_checkpoint_tensors_are_not_unmatched_when_a_module_rule_could_own_them():
    text = HEAD + f'  - name: lin\n    match: {{module: Linear}}\n    geometry: {EUCLID}\n'
    codes = {d.code for d in _lint(text, CKPT)}
    assert "GO112" in codes and "GO101" not in codes and "GO102" not in codes


def test_model_rules_are_skipped_for_the_spec_alone():
    text = HEAD + f'  - name: typo\n    match: "nothing.*"\n    geometry: {EUCLID}\n'
    assert _lint(text, None) == []
    assert {d.code for d in _lint(text, "mlp")} == {"GO101", "GO102"}


def test_findings_are_sorted_by_position():
    text = HEAD + ('  - name: a\n    match: "**"\n    geometry: {kind: adam}\n'
                   '  - name: b\n    match: "x"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n'
                   '    constraint: {kind: l0, k: 1}\n')
    diags = _lint(text, "mlp")
    assert [(d.line, d.col) for d in diags] == sorted((d.line, d.col) for d in diags)
    assert {"GO102", "GO105", "GO109"} <= {d.code for d in diags}


# ---------------------------------------------------------------- the shipped specs are clean


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_are_clean(spec_path):
    spec = geomopt.load_spec(spec_path)
    allowed_notes = {"GO109"}  # adam hybrids are outside the theory, by design
    assert {d.code for d in lint_spec(spec)} <= allowed_notes
    assert {d.code for d in lint_spec(spec, model_params(MODELS["gpt"]())[0])} <= allowed_notes
    for name in ("mlp", "cnn"):  # no embeddings there: a rule for them is idle (a note)
        diags = lint_spec(spec, model_params(MODELS[name]())[0])
        assert {d.code for d in diags} <= allowed_notes | {"GO113"}


# ---------------------------------------------------------------- the registry


@pytest.mark.parametrize("code", sorted(RULES))
def test_registered_rule_is_complete(code):
    rule = RULES[code]
    assert rule.code == code and re.fullmatch(r"GO1\d\d", code)
    assert re.fullmatch(r"[a-z]+(-[a-z]+)+", rule.name)
    assert rule.severity in {"error", "warning", "note"}
    assert rule.doc and len(rule.doc.splitlines()[0]) > 20
    assert ("Bad" in rule.doc and "Fixed" in rule.doc) or "Example" in rule.doc, "docstring needs an example"


def test_rule_codes_and_names_are_unique_and_disjoint_from_language_codes():
    names = [r.name for r in RULES.values()] + [name for name, _ in LANGUAGE_CODES.values()]
    assert len(names) == len(set(names))
    assert not set(RULES) & set(LANGUAGE_CODES)


@pytest.mark.parametrize("code", sorted(RULES))
def test_geomopt_rule_prints_the_docstring(code, capsys):
    assert main(["rule", code]) == 0
    out = capsys.readouterr().out
    rule = RULES[code]
    assert out.startswith(f"{code} {rule.name} ({rule.severity})")
    assert rule.doc in out
    assert main(["rule", code.lower()]) == 0 and capsys.readouterr().out == out


def test_geomopt_rule_explains_language_codes_and_lists_everything(capsys):
    assert main(["rule", "GO002"]) == 0
    assert "duplicate-key" in capsys.readouterr().out
    assert main(["rule"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines]
    assert listed == sorted(LANGUAGE_CODES) + sorted(RULES)
    for line in lines:
        code, name, severity, *summary = line.split()
        assert summary and (code in LANGUAGE_CODES or (RULES[code].name, RULES[code].severity) == (name, severity))


@pytest.mark.parametrize("method", ["shampoo", "soap", "psgd"])
def test_batched_experts_under_every_kronecker_method_are_one_matrix_until_view_auto(method):
    """GO117 for each kronecker method (its fixtures show Shampoo): the 4 experts (4, 16, 8) and
    (4, 8, 16) without a view share one pair of factors of the flattened 4 × 128; ``view: auto`` gives
    each expert its own, and the warning goes."""
    from test_lint_fixtures import target_params

    params, _ = target_params("moe")
    geometry = f"{{kind: kronecker, method: {method}"
    text = (HEAD + "  - {name: io, match: {role: [head, router]}, geometry: {kind: adam}}\n"
            f"  - {{name: hidden, match: {{role: [hidden, expert]}}, geometry: {geometry}}}}}\n"
            "  - {name: rest, match: \"**\", geometry: {kind: adam}}\n")
    found = [d for d in lint_spec(geomopt.parse_spec(text, "yaml", file="t.yaml"), params) if d.code == "GO117"]
    assert sorted(d.message.split("'")[3] for d in found) == ["block.experts.w_in", "block.experts.w_out"]
    assert all("one pair of Kronecker factors of the flattened 4 × 128" in d.message for d in found)
    fixed = text.replace(geometry, geometry + ", view: auto")
    assert not [d for d in lint_spec(geomopt.parse_spec(fixed, "yaml", file="t.yaml"), params) if d.code == "GO117"]
