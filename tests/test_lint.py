"""Lint rules GO101–GO112: a fixture table of (spec text, target, expected code, line:col), the
clean shipped specs, and the rule registry (codes, names, severities, docstrings, `geomopt rule`).

A new case is a new row. ``target`` is a reference model name, a callable returning an
``nn.Module`` or a list of ParamInfo (a checkpoint: names and shapes only), or None (the spec
alone). ``fixed`` is the same spec with the problem repaired: the code must not fire on it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn

import geomopt
from geomopt.cli.main import main
from geomopt.compile import ParamInfo, lint_spec
from geomopt.compile.compiler import model_params
from geomopt.compile.lint import RULES
from geomopt.compile.params import params_from_model
from geomopt.models import GPT, GPTConfig, MODELS
from geomopt.spec.diagnostics import LANGUAGE_CODES

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted([*(ROOT / "specs").glob("*.yaml"), *(ROOT / "specs").glob("*.geom")])  # YAML and DSL

HEAD = "geomopt: 1\nname: t\nrules:\n"  # rules start on line 4; the list itself sits at 4:3


def _frozen_gpt():
    model = GPT(GPTConfig())
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def _tied_gpt():
    return GPT(GPTConfig(tie_weights=True))


def _ckpt(*rows):
    return lambda: [ParamInfo(name=n, shape=s, modules=None) for n, s in rows]


CKPT = _ckpt(("fc.weight", (4, 3)), ("fc.bias", (4,)))


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 16, 8))
        self.w_out = nn.Parameter(torch.randn(4, 8, 16))


class _MoE(nn.Module):
    """A mixture-of-experts block (router + 4 batched experts) and a head."""

    def __init__(self):
        super().__init__()
        self.block = nn.Module()
        self.block.gate = nn.Linear(8, 4, bias=False)
        self.block.experts = _Experts()
        self.block.proj = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 5)


SPECTRAL = "{kind: spectral, reference: {kind: indicator}}"
ADAM_REST = '  - {name: rest, match: "**", geometry: {kind: adam}}\n'
BY_ROLE = f'  - name: io\n    match: {{role: [head, router]}}\n    geometry: {{kind: adam}}\n'
ROLE_CKPT = _ckpt(("emb.weight", (10, 4)), ("layers.0.weight", (4, 4)), ("lm_head.weight", (10, 4)))
EUCLID = "{kind: euclidean}"
REST = f'  - {{name: rest, match: "**", geometry: {EUCLID}}}\n'


class Row(NamedTuple):
    id: str
    text: str
    target: object
    code: str
    at: str  # "line:col"
    fixed: Optional[str] = None
    format: str = "yaml"


ROWS = [
    Row("GO101-model", HEAD + f'  - name: hidden\n    match: "layers.*.weight"\n    geometry: {EUCLID}\n',
        "mlp", "GO101", "4:3",
        fixed=HEAD + f'  - name: hidden\n    match: "layers.*.weight"\n    geometry: {EUCLID}\n' + REST),
    Row("GO101-checkpoint", HEAD + f'  - name: w\n    match: "**.weight"\n    geometry: {EUCLID}\n',
        CKPT, "GO101", "4:3",
        fixed=HEAD + f'  - name: w\n    match: "**.weight"\n    geometry: {EUCLID}\n' + REST),
    Row("GO101-dsl", 'geomopt 1\nname "t"\n\nrule hidden match "layers.*.weight":\n    geometry euclidean\n',
        "mlp", "GO101", "4:1", format="dsl",
        fixed='geomopt 1\nname "t"\n\nrule hidden match "**":\n    geometry euclidean\n'),
    Row("GO102", HEAD + f'  - name: typo\n    match: "layer.*.weight"\n    geometry: {EUCLID}\n' + REST,
        "mlp", "GO102", "5:12",
        fixed=HEAD + f'  - name: typo\n    match: "layers.*.weight"\n    geometry: {EUCLID}\n' + REST),
    Row("GO102-module", HEAD + f'  - name: emb\n    match: {{module: Embedding}}\n    geometry: {EUCLID}\n' + REST,
        "mlp", "GO102", "5:12",
        fixed=HEAD + f'  - name: emb\n    match: {{module: Linear}}\n    geometry: {EUCLID}\n' + REST),
    Row("GO103", HEAD + REST + f'  - name: late\n    match: "*.bias"\n    geometry: {EUCLID}\n',
        "mlp", "GO103", "6:12",
        fixed=HEAD + f'  - name: late\n    match: "*.bias"\n    geometry: {EUCLID}\n' + REST),
    Row("GO104-vector", HEAD + '  - name: all\n    match: "**"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n',
        lambda: nn.Linear(4, 3), "GO104", "6:22",
        fixed=HEAD + '  - name: all\n    match: {name: "**", ndim: 2}\n    geometry: {kind: spectral, reference: {kind: indicator}}\n'
        + REST),
    Row("GO104-view", HEAD + '  - name: qkv\n    match: "**"\n    geometry:\n      kind: spectral\n'
        '      reference: {kind: indicator}\n      view: {kind: matrix, blocks: 5}\n',
        lambda: nn.Linear(64, 192, bias=False), "GO104", "9:13",
        fixed=HEAD + '  - name: qkv\n    match: "**"\n    geometry:\n      kind: spectral\n'
        '      reference: {kind: indicator}\n      view: {kind: matrix, blocks: 3}\n'),
    Row("GO105", HEAD + '  - name: all\n    match: "**"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n'
        '    constraint: {kind: l0, k: 3}\n',
        None, "GO105", "7:24",
        fixed=HEAD + '  - name: all\n    match: "**"\n    geometry: {kind: spectral, reference: {kind: indicator}}\n'
        '    constraint: {kind: rank, k: 3}\n'),
    Row("GO105-dsl", 'geomopt 1\nname "t"\n\nrule all match "**":\n    geometry adam\n    constraint l2_ball(radius=1.0)\n',
        None, "GO105", "6:16", format="dsl",
        fixed='geomopt 1\nname "t"\n\nrule all match "**":\n    geometry adam\n'),
    Row("GO106-eps", HEAD + '  - name: all\n    match: "**"\n'
        '    geometry: {kind: isotropic, reference: {kind: log_barrier, eps: 1.0e-20}}\n',
        None, "GO106", "6:69",
        fixed=HEAD + '  - name: all\n    match: "**"\n'
        '    geometry: {kind: isotropic, reference: {kind: log_barrier, eps: 1.0e-8}}\n'),
    Row("GO106-adam-eps", HEAD + '  - name: all\n    match: "**"\n    geometry:\n      kind: adam\n      eps: 1.0e-13\n',
        None, "GO106", "8:12",
        fixed=HEAD + '  - name: all\n    match: "**"\n    geometry:\n      kind: adam\n      eps: 1.0e-12\n'),
    Row("GO106-scale", HEAD + '  - name: emb\n    match: "**"\n'
        '    geometry: {kind: anisotropic, reference: {kind: indicator}, scale: scion}\n',
        _ckpt(("wte.weight", (64, 50000))), "GO106", "6:72",
        fixed=HEAD + '  - name: emb\n    match: "**"\n'
        '    geometry: {kind: anisotropic, reference: {kind: indicator}, scale: scion, layout: in_out}\n'),
    Row("GO107", HEAD + '  - name: hidden\n    match: "**"\n    geometry:\n      kind: spectral\n'
        '      reference: {kind: log_barrier}\n      approx: {kind: polar_express, steps: 5}\n'
        '    constraint: {kind: frobenius_ball, radius: 1.0}\n',
        None, "GO107", "8:18",
        fixed=HEAD + '  - name: hidden\n    match: "**"\n    geometry:\n      kind: spectral\n'
        '      reference: {kind: power_barrier, kappa: 4.0, eps: 1.05e-3}\n'
        '      approx: {kind: polar_express, steps: 5}\n    constraint: {kind: frobenius_ball, radius: 1.0}\n'),
    Row("GO108", HEAD + '  - name: hidden\n    match: "**"\n    weight_decay: 0.1\n'
        '    geometry: {kind: spectral, reference: {kind: indicator}}\n    constraint: {kind: stiefel}\n',
        None, "GO108", "8:24",
        fixed=HEAD + '  - name: hidden\n    match: "**"\n    weight_decay: 0.1\n'
        '    geometry: {kind: spectral, reference: {kind: indicator}}\n    constraint: {kind: spectral_ball}\n'),
    Row("GO108-default", "geomopt: 1\nname: t\ndefaults: {weight_decay: 0.1}\nrules:\n  - name: signs\n    match: \"**\"\n"
        "    geometry: {kind: anisotropic, reference: {kind: indicator}}\n    constraint: {kind: sign_set}\n",
        None, "GO108", "8:24",
        fixed="geomopt: 1\nname: t\ndefaults: {weight_decay: 0.1}\nrules:\n  - name: signs\n    match: \"**\"\n"
        "    weight_decay: 0.0\n"
        "    geometry: {kind: anisotropic, reference: {kind: indicator}}\n    constraint: {kind: sign_set}\n"),
    Row("GO109-adam", HEAD + '  - name: all\n    match: "**"\n    geometry: {kind: adam}\n',
        None, "GO109", "6:22",
        fixed=HEAD + f'  - name: all\n    match: "**"\n    geometry: {EUCLID}\n'),
    Row("GO109-indicator", HEAD + '  - name: all\n    match: "**"\n'
        '    geometry: {kind: isotropic, reference: {kind: indicator}}\n    constraint: {kind: l2_ball}\n',
        None, "GO109", "6:44",
        fixed=HEAD + '  - name: all\n    match: "**"\n'
        '    geometry: {kind: isotropic, reference: {kind: log_barrier}}\n    constraint: {kind: l2_ball}\n'),
    Row("GO110", HEAD + f'  - name: all\n    match: "**"\n    geometry: {EUCLID}\n', _frozen_gpt, "GO110", "4:3",
        fixed=None),
    Row("GO111", HEAD + f'  - name: all\n    match: "**"\n    geometry: {EUCLID}\n', _tied_gpt, "GO111", "4:3"),
    Row("GO112", HEAD + f'  - name: lin\n    match: {{name: "*.weight", module: Linear}}\n    geometry: {EUCLID}\n' + REST,
        CKPT, "GO112", "5:39",
        fixed=HEAD + f'  - name: lin\n    match: {{name: "*.weight"}}\n    geometry: {EUCLID}\n' + REST),
    Row("GO113", HEAD + f'  - name: emb\n    match: {{role: embedding}}\n    geometry: {EUCLID}\n' + REST,
        "mlp", "GO113", "5:19",
        fixed=HEAD + f'  - name: out\n    match: {{role: head}}\n    geometry: {EUCLID}\n' + REST),
    Row("GO114", 'geomopt: 1\nname: t\nroles:\n  head: ["hed.weight"]\nrules:\n' + REST, "mlp", "GO114", "4:10",
        fixed='geomopt: 1\nname: t\nroles:\n  head: ["head.weight"]\nrules:\n' + REST),
    Row("GO115", HEAD + f'  - name: hidden\n    match: {{name: "**.weight", ndim: 2}}\n    geometry: {SPECTRAL}\n' + ADAM_REST,
        "mlp", "GO115", "5:12",
        fixed=HEAD + BY_ROLE + f'  - name: hidden\n    match: {{name: "**.weight", ndim: 2}}\n    geometry: {SPECTRAL}\n'
        + ADAM_REST),
    Row("GO116", HEAD + BY_ROLE + f'  - name: hidden\n    match: {{name: "**.weight", ndim: 2}}\n    geometry: {SPECTRAL}\n'
        + ADAM_REST, _MoE, "GO116", "10:25",
        fixed=HEAD + BY_ROLE + f'  - name: hidden\n    match: {{role: [hidden, expert]}}\n    geometry: {SPECTRAL}\n'
        + ADAM_REST),
    Row("GO117", HEAD + BY_ROLE + f'  - name: hidden\n    match: {{role: [hidden, expert]}}\n    geometry: {SPECTRAL}\n'
        + ADAM_REST, _MoE, "GO117", "9:22",
        fixed=HEAD + BY_ROLE + '  - name: hidden\n    match: {role: [hidden, expert]}\n'
        '    geometry: {kind: spectral, reference: {kind: indicator}, view: auto}\n' + ADAM_REST),
    Row("GO118", HEAD + BY_ROLE + ADAM_REST, ROLE_CKPT, "GO118", "4:3",
        fixed=HEAD + '  - {name: io, match: "lm_head.weight", geometry: {kind: adam}}\n' + ADAM_REST),
    Row("GO119", HEAD + BY_ROLE + ADAM_REST, _TwoHeads, "GO119", "4:3"),
    Row("GO120", HEAD + f'  - name: all\n    match: "**"\n    geometry: {EUCLID}\n'
        '    post: [{kind: second_moment, axis: row}]\n', CKPT, "GO120", "7:40",
        fixed=HEAD + f'  - name: all\n    match: "**"\n    geometry: {EUCLID}\n'
        '    post: [{kind: second_moment, axis: element}]\n'),
    Row("GO121", HEAD + '  - name: signs\n    match: "**"\n    geometry: {kind: anisotropic, reference: {kind: indicator}}\n'
        '    post: [{kind: second_moment, axis: element}]\n', None, "GO121", "7:19",
        fixed=HEAD + '  - name: signs\n    match: "**"\n    geometry: {kind: anisotropic, reference: {kind: indicator}}\n'
        '    post: [{kind: cautious}]\n'),
    Row("GO122", HEAD + f'  - name: hidden\n    match: "**"\n    geometry: {SPECTRAL}\n    post: [cautious]\n'
        '    constraint: {kind: spectral_ball}\n', None, "GO122", "7:12",
        fixed=HEAD + f'  - name: hidden\n    match: "**"\n    geometry: {SPECTRAL}\n    post: [cautious]\n'),
    Row("GO122-decay", HEAD + f'  - name: hidden\n    match: "**"\n    geometry: {SPECTRAL}\n    weight_decay: 0.1\n'
        '    decay: cautious\n    constraint: {kind: frobenius_ball}\n', None, "GO122", "8:12",
        fixed=HEAD + f'  - name: hidden\n    match: "**"\n    geometry: {SPECTRAL}\n    weight_decay: 0.1\n'
        '    decay: cautious\n'),
]


def _lint(text: str, target, fmt: str = "yaml"):
    spec = geomopt.parse_spec(text, fmt, file="t." + ("yaml" if fmt == "yaml" else "geom"))
    if target is None:
        return lint_spec(spec)
    built = MODELS[target]() if isinstance(target, str) else target()
    if isinstance(built, list):  # a checkpoint's ParamInfos
        return lint_spec(spec, built, from_checkpoint=True)
    return lint_spec(spec, model_params(built)[0])


def test_table_covers_every_rule():
    assert {r.code for r in ROWS} == set(RULES)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_rule_fires_at_its_position(row: Row):
    diags = _lint(row.text, row.target, row.format)
    found = [f"{d.line}:{d.col}" for d in diags if d.code == row.code]
    assert row.at in found, [d.format() for d in diags]
    d = next(d for d in diags if d.code == row.code and f"{d.line}:{d.col}" == row.at)
    rule = RULES[row.code]
    assert (d.name, d.severity) == (rule.name, rule.severity)
    assert d.file.startswith("t.") and d.message


@pytest.mark.parametrize("row", [r for r in ROWS if r.fixed is not None], ids=[r.id for r in ROWS if r.fixed is not None])
def test_rule_does_not_fire_on_the_fixed_spec(row: Row):
    diags = _lint(row.fixed, row.target, row.format)
    assert row.code not in {d.code for d in diags}, [d.format() for d in diags]


def test_messages_say_what_and_where():
    by_id = {r.id: r for r in ROWS}
    text = {r.id: " ".join(d.message for d in _lint(r.text, r.target, r.format) if d.code == r.code) for r in ROWS}
    assert "'layers.0.bias'" in text["GO101-model"] and "nearest patterns: 'layers.*.weight'" in text["GO101-model"]
    assert "'fc.bias'" in text["GO101-checkpoint"]
    assert "rule 'typo'" in text["GO102"]
    assert "rule 'late'" in text["GO103"] and "rest" in text["GO103"]
    assert "'bias'" in text["GO104-vector"] and "blocks=5" in text["GO104-view"]
    assert "supports:" in text["GO105"] and "rank" in text["GO105"]
    assert "eps=1e-20" in text["GO106-eps"] and "'wte.weight'" in text["GO106-scale"]
    assert "eps≈" in text["GO107"] and "stiefel" in text["GO108"] and "weight_decay=0.1" in text["GO108-default"]
    assert "transformer.wpe.weight" in text["GO110"]
    assert "'transformer.wte.weight'" in text["GO111"] and "'lm_head.weight'" in text["GO111"]
    assert "module=Linear" in text["GO112"]
    assert "no tensor of this model has role embedding" in text["GO113"] and "'hed.weight'" in text["GO114"]
    assert "'head.weight'" in text["GO115"] and "role head" in text["GO115"] and "last layer" in text["GO115"]
    assert "'block.experts.w_in' (4×16×8, expert)" in text["GO116"]
    assert "4 experts" in text["GO117"] and "view: auto" in text["GO117"]
    assert "'lm_head.weight' → head" in text["GO118"] and "'head_a.weight'" in text["GO119"] and "'head_b.weight'" in text["GO119"]
    assert all(text[i] for i in by_id)


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
