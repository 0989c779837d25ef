"""Which parameters a rule owns: whole-name globs and regexes, module classes (base classes too),
ndim, shape; first match wins; tied and frozen parameters.

The tables are (pattern, name, expected) rows; a new case is a new row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import geomopt
from geomopt.compile import ParamInfo, compile_spec, glob_regex
from geomopt.lint import lint_spec
from geomopt.compile.match import Matcher, matches
from geomopt.compile.params import params_from_model
from geomopt.spec.model import Match

# (pattern, name, expected): globs on dotted names and `re:` full-match regexes.
NAME_ROWS = [
    # `*`: any run of characters within one segment
    ("*", "bias", True),
    ("*", "h.bias", False),
    ("h.*.weight", "h.0.weight", True),
    ("h.*.weight", "h.0.attn.weight", False),
    ("h.*.weight", "h..weight", True),  # `*` may be empty
    ("*.weight", "fc.weight", True),
    ("*head.weight", "decode_head.weight", True),
    ("*_proj.*", "c_proj.weight", True),
    ("*_proj.*", "h.0.c_proj.weight", False),
    # `**`: across segments
    ("**", "a", True),
    ("**", "transformer.h.0.attn.c_attn.weight", True),
    ("h.**.weight", "h.0.attn.c_attn.weight", True),
    ("h.**.weight", "h.weight", True),  # `**.` may stand for no segment at all
    ("h.**", "h.0.weight", True),
    ("h.**", "hx.0.weight", False),
    ("**.weight", "h.0.weight", True),
    ("**.weight", "h.0.weights", False),
    ("**.bias", "bias", True),  # a top-level `bias`
    ("**.bias", "h.0.attn.bias", True),
    ("**.bias", "xbias", False),
    ("**.bias", "h.0.xbias", False),
    ("**bias", "h.0.xbias", True),
    # `?`: exactly one character, never a dot
    ("h.?.weight", "h.1.weight", True),
    ("h.?.weight", "h.10.weight", False),
    ("h.?.weight", "h..weight", False),
    ("a?b", "a.b", False),
    ("ln_?.weight", "ln_1.weight", True),
    # other characters are literal (a dot is not a regex wildcard; brackets are not classes)
    ("a.b", "aXb", False),
    ("h.[0].w", "h.[0].w", True),
    ("h.[0].w", "h.0.w", False),
    ("w+", "ww", False),
    # whole names only: no substring matches (the mmengine trap)
    ("layers.1.weight", "layers.10.weight", False),
    ("layers.1.*", "layers.10.weight", False),
    ("layers.1.**", "layers.10.weight", False),
    ("layers.1.**", "layers.1.attn.weight", True),
    ("layers.1", "layers.10", False),
    ("head", "decode_head", False),
    ("head.weight", "decode_head.weight", False),
    ("head.*", "decode_head.weight", False),
    ("weight", "h.0.weight", False),
    ("h.0", "h.0.weight", False),
    # regexes: full match
    ("re:head\\..*", "decode_head.weight", False),
    ("re:.*head\\.weight", "decode_head.weight", True),
    ("re:layers\\.1", "layers.10", False),
    ("re:layers\\.1", "layers.1", True),
    ("re:layers\\.\\d+\\.weight", "layers.10.weight", True),
    ("re:layers\\.\\d+\\.weight", "layers.10.weight.x", False),
    ("re:(lm_)?head\\.weight", "lm_head.weight", True),
    ("re:(lm_)?head\\.weight", "head.weight", True),
    ("re:(lm_)?head\\.weight", "decode_head.weight", False),
    ("re:.*\\.(h|layers)\\..*\\.weight", "transformer.h.0.attn.c_attn.weight", True),
    ("re:.*\\.(h|layers)\\..*\\.weight", "transformer.wte.weight", False),
    ("re:a|b", "ab", False),  # alternation is inside the full match, not `a` or `b` anywhere
    ("re:a|b", "b", True),
]


@pytest.mark.parametrize("pattern, name, expected", NAME_ROWS)
def test_name_pattern(pattern, name, expected):
    assert (glob_regex(pattern).fullmatch(name) is not None) is expected
    info = ParamInfo(name=name, shape=(2, 2))
    assert matches(Match(name=pattern), info) is expected
    hits, undecided = Matcher(Match(name=pattern)).select([info])
    assert (hits == [0]) is expected and undecided == []


def test_matcher_select_agrees_with_matches_on_every_row():
    """The batched path (used by the compiler) and the per-tensor path are one predicate."""
    infos = [ParamInfo(name=n, shape=(3,) * (i % 3), modules=(None if i % 4 == 0 else ("Linear",)))
             for i, (_, n, _) in enumerate(NAME_ROWS)]
    for pattern in {p for p, _, _ in NAME_ROWS}:
        for match in (Match(name=pattern), Match(name=pattern, ndim=[1, 2]), Match(name=pattern, module="Linear")):
            per_tensor = [matches(match, p) for p in infos]
            hits, undecided = Matcher(match).select(infos)
            assert hits == [i for i, m in enumerate(per_tensor) if m is True]
            assert undecided == [i for i, m in enumerate(per_tensor) if m is None]


# (match fields, shape, expected)
SHAPE_ROWS = [
    ({"ndim": 2}, (4, 3), True),
    ({"ndim": 2}, (4,), False),
    ({"ndim": 0}, (), True),
    ({"ndim": [2, 3, 4, 5]}, (8, 3, 3, 3), True),
    ({"ndim": [2, 3, 4, 5]}, (8,), False),
    ({"ndim": [1]}, (8,), True),
    ({"shape": [4, 3]}, (4, 3), True),
    ({"shape": [4, 3]}, (3, 4), False),
    ({"shape": [4, "*"]}, (4, 7), True),
    ({"shape": [4, "*"]}, (5, 7), False),
    ({"shape": ["*", "*"]}, (5, 7), True),
    ({"shape": ["*", "*"]}, (5, 7, 1), False),  # "*" stands for one dimension, not many
    ({"shape": ["*"]}, (5, 7), False),
    ({"shape": []}, (), True),
    ({"name": "**.weight", "ndim": 2}, (4, 3), True),
    ({"name": "**.weight", "ndim": 1}, (4, 3), False),
    ({"ndim": 2, "shape": [4, "*"]}, (4, 3), True),
    ({"ndim": 3, "shape": [4, "*"]}, (4, 3), False),
]


@pytest.mark.parametrize("fields, shape, expected", SHAPE_ROWS)
def test_ndim_and_shape(fields, shape, expected):
    assert matches(Match(**fields), ParamInfo(name="blocks.0.weight", shape=shape)) is expected


# ---------------------------------------------------------------- module predicate


class _WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.conv = nn.Conv2d(1, 2, 3)
        self.norm = nn.LayerNorm(8)


def _infos(model):
    return {p.name: p for p in params_from_model(model)[0]}


# (module class name, parameter, expected)
MODULE_ROWS = [
    ("Linear", "attn.out_proj.weight", True),  # NonDynamicallyQuantizableLinear subclasses Linear
    ("NonDynamicallyQuantizableLinear", "attn.out_proj.weight", True),
    ("Linear", "attn.out_proj.bias", True),
    ("MultiheadAttention", "attn.in_proj_weight", True),
    ("MultiheadAttention", "attn.out_proj.weight", False),  # owned by out_proj, not by attn
    ("Linear", "attn.in_proj_weight", False),
    ("Conv2d", "conv.weight", True),
    ("_ConvNd", "conv.weight", True),  # a base class
    ("Linear", "conv.weight", False),
    ("LayerNorm", "norm.weight", True),
    ("Module", "norm.weight", False),  # the universal base is not a useful predicate
    ("linear", "attn.out_proj.weight", False),  # class names are case-sensitive
]


@pytest.mark.parametrize("module, name, expected", MODULE_ROWS)
def test_module_predicate_includes_base_classes(module, name, expected):
    info = _infos(_WithAttention())[name]
    assert matches(Match(module=module), info) is expected


def test_module_of_a_top_level_parameter_is_the_root_module():
    info = _infos(nn.Linear(3, 4))["weight"]
    assert matches(Match(module="Linear"), info) is True
    assert matches(Match(name="**.weight", module="Linear"), info) is True


def test_module_predicate_is_undecidable_without_module_information():
    ckpt = ParamInfo(name="fc.weight", shape=(4, 3), modules=None)
    assert matches(Match(module="Linear"), ckpt) is None
    # the other predicates still decide first: a failing name is a plain no
    assert matches(Match(name="other.*", module="Linear"), ckpt) is False


def test_module_rule_owns_out_proj_through_compile():
    spec = {"geomopt": 1, "name": "t", "rules": [
        {"name": "linear", "match": {"module": "Linear", "ndim": 2},
         "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}}},
        {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}},
    ]}
    plan = compile_spec(spec, _WithAttention())
    assert plan["attn.out_proj.weight"].rule == "linear"
    assert plan["attn.in_proj_weight"].rule == "rest"
    assert plan["conv.weight"].rule == "rest"


# ---------------------------------------------------------------- first match wins


def _spec(*rules, defaults=None) -> geomopt.Spec:
    return geomopt.compile.as_spec({"geomopt": 1, "name": "t", "defaults": defaults or {}, "rules": list(rules)})


def _rule(name, match, kind="euclidean", **extra):
    geometry = {"kind": kind} if kind in ("euclidean", "adam") else {"kind": kind, "reference": {"kind": "indicator"}}
    return {"name": name, "match": match, "geometry": geometry, **extra}


def test_first_matching_rule_wins():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    spec = _spec(_rule("first", "0.*", lr=0.1), _rule("matrices", {"ndim": 2}, lr=0.2), _rule("rest", "**", lr=0.3))
    plan = compile_spec(spec, model)
    assert {p.name: p.rule for p in plan} == {
        "0.weight": "first", "0.bias": "first", "1.weight": "matrices", "1.bias": "rest"}
    assert [plan[n].lr for n in ("0.weight", "1.weight", "1.bias")] == [0.1, 0.2, 0.3]
    # reordering the rules changes the owner
    plan = compile_spec(_spec(_rule("matrices", {"ndim": 2}), _rule("first", "0.*"), _rule("rest", "**")), model)
    assert plan["0.weight"].rule == "matrices" and plan["0.bias"].rule == "first"


def test_rule_order_decides_even_when_a_later_rule_is_more_specific():
    model = nn.Sequential(nn.Linear(4, 4))
    plan = compile_spec(_spec(_rule("all", "**"), _rule("exact", "0.weight")), model)
    assert plan["0.weight"].rule == "all"
    assert "GO103" in {d.code for d in lint_spec(_spec(_rule("all", "**"), _rule("exact", "0.weight")),
                                                 params_from_model(model)[0])}


# ---------------------------------------------------------------- tied parameters


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight


def test_tied_parameter_is_planned_once_under_its_first_name():
    infos = params_from_model(_Tied())[0]
    assert [p.name for p in infos] == ["wte.weight", "body.weight", "body.bias"]
    assert infos[0].aliases == ("lm_head.weight",)
    plan = compile_spec(_spec(_rule("all", "**")), _Tied())
    assert len(plan) == 3
    assert plan["lm_head.weight"] is plan["wte.weight"]
    assert plan["wte.weight"].aliases == ("lm_head.weight",)


@pytest.mark.parametrize("match", ["lm_head.weight", "re:lm_.*", {"module": "Linear", "ndim": 2, "shape": [16, 8]}])
def test_a_rule_matching_any_alias_matches_the_tied_tensor(match):
    spec = _spec(_rule("head", match, lr=0.5), _rule("rest", "**"))
    plan = compile_spec(spec, _Tied())
    assert plan["wte.weight"].rule == "head" and plan["wte.weight"].lr == 0.5
    assert plan["body.weight"].rule == "rest"


def test_tied_parameter_module_classes_are_those_of_every_name():
    (wte, *_) = params_from_model(_Tied())[0]
    assert set(wte.modules) >= {"Embedding", "Linear"}


def test_tied_parameters_are_noted():
    infos = params_from_model(_Tied())[0]
    diags = lint_spec(_spec(_rule("all", "**")), infos)
    assert [d.code for d in diags] == ["GO111"]
    assert "wte.weight" in diags[0].message and "lm_head.weight" in diags[0].message


# ---------------------------------------------------------------- frozen parameters


def test_frozen_parameters_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    # a rule set that would leave 0.weight unmatched: frozen parameters need no rule
    spec = _spec(_rule("rest", {"name": "**", "shape": ["*"]}), _rule("out", "1.weight"))
    plan = compile_spec(spec, model)
    assert [p.name for p in plan] == ["0.bias", "1.weight", "1.bias"]
    assert plan.frozen == ["0.weight"]
    with pytest.raises(KeyError):
        plan["0.weight"]
    assert "1 frozen (skipped): 0.weight" in plan.table()
    diags = lint_spec(spec, params_from_model(model)[0])
    assert [(d.code, d.severity) for d in diags] == [("GO110", "note")]
    assert "0.weight" in diags[0].message


def test_iterable_input_freezes_only_parameters_that_say_so():
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    named = [("a", nn.Parameter(torch.zeros(2, 2))), ("b", frozen), ("c", torch.zeros(4))]  # c: a plain tensor
    plan = compile_spec(_spec(_rule("all", "**")), named)
    assert [p.name for p in plan] == ["a", "c"] and plan.frozen == ["b"]


def test_iterable_input_has_no_module_information():
    named = [("fc.weight", nn.Parameter(torch.zeros(2, 2)))]
    infos = params_from_model(named)[0]
    assert infos[0].modules is None
    # a tensor that only a module rule could own cannot be planned from names alone
    with pytest.raises(geomopt.SpecError) as exc:
        compile_spec(_spec(_rule("linear", {"module": "Linear"})), named)
    assert "module" in str(exc.value) and "fc.weight" in str(exc.value)


def test_iterable_input_rejects_one_name_for_two_tensors():
    with pytest.raises(ValueError, match="'a' appears twice"):
        params_from_model([("a", torch.zeros(2)), ("a", torch.zeros(3))])
