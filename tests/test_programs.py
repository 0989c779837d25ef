"""Step programs (geomopt.optim.engine.program): each bucket's variant is chosen once by one dispatcher,
with its reasons; ``opt.describe()`` and ``geomopt plan … --program`` show them; every
hyper-parameter a step reads is the group's (one source of truth), and a change to what a program
depends on builds it again."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import SHIPPED, gpt_batch, mlp_batch, params_equal, tiny_gpt, tiny_mlp, train

import geomopt
import geomopt.optim.engine.engine as optimizer_module
from geomopt.cli.main import main
from geomopt.geometry import polynomial


def _opt(spec, model=None, **kw):
    model = model if model is not None else tiny_gpt(0)
    return model, geomopt.GeomOptimizer(model, spec, **kw)


@pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")
@pytest.mark.parametrize("spec", SHIPPED, ids=lambda p: p.stem)
def test_every_stepping_tensor_is_in_exactly_one_program_and_described(spec):
    model, opt = _opt(str(spec))
    names = [pp.name for progs in opt.engine.programs for prog in progs for pp in
             (opt.engine.plans[prog.group][i] for i in prog.indices)]
    stepping = [pp.name for plans in opt.engine.plans for pp in plans if pp.shape and all(pp.shape)]
    assert sorted(names) == sorted(stepping) and len(set(names)) == len(names)
    text = opt.describe()
    for progs in opt.engine.programs:
        for prog in progs:
            assert prog.stages[0].startswith("direction ") and prog.stages[1].startswith("forward ")
            assert prog.variant in ("flat", "batched") and prog.why
            assert prog.describe() in text


def test_the_dispatcher_chooses_each_variant_for_its_reason(monkeypatch):
    # CPU: torch.optim.Muon's op order, so the spectral buckets update in place and test first
    _, opt = _opt("muon")
    hidden = [p for progs in opt.engine.programs for p in progs if p.rule == "hidden"]
    assert hidden and all(p.variant == "batched" and p.write == "in-place" and p.direction_form == "rows"
                          and p.check == "before" for p in hidden)
    assert all(p.variant == "flat" and p.fused for progs in opt.engine.programs for p in progs if p.rule == "rest")
    _, opt = _opt("muon", implementation="foreach")
    assert all(p.write == "foreach" and not p.fused for progs in opt.engine.programs for p in progs if p.rule == "rest")
    # the short forms (CUDA's): one pass over X, Polyak read ahead, the test deferred
    monkeypatch.setattr(polynomial, "_MUON_ORDER_DEVICES", ())
    _, opt = _opt("muon")
    hidden = [p for progs in opt.engine.programs for p in progs if p.rule == "hidden"]
    assert all(p.write == "one-pass" and p.direction_form == "ahead" and p.check == "deferred" for p in hidden)
    assert opt.engine.deferred
    # a constraint, tracking or bf16 parameters write back from a stacked copy
    _, opt = _opt("stiefel", tiny_mlp(0))
    assert {p.write for progs in opt.engine.programs for p in progs if p.variant == "batched"} == {"stacked"}
    _, opt = _opt("muon", track_update=True)
    assert all(p.variant == "batched" and p.write == "stacked" for progs in opt.engine.programs for p in progs)
    _, opt = _opt("muon", tiny_gpt(0).to(torch.bfloat16))
    assert all(p.write == "stacked" and "bfloat16" in " ".join(p.why)
               for progs in opt.engine.programs for p in progs if p.variant == "batched")


def test_programs_are_built_once_and_again_only_when_a_group_value_they_read_changes(monkeypatch):
    calls = []
    real = optimizer_module.dispatch
    monkeypatch.setattr(optimizer_module, "dispatch", lambda *a: calls.append(1) or real(*a))
    model, opt = _opt("muon")
    train(model, opt, 3, gpt_batch)
    assert len(calls) == 1  # at construction only
    for g in opt.param_groups:
        g["lr"] *= 0.5  # a schedule: the programs do not read it
    train(model, opt, 1, gpt_batch, start=3)
    assert len(calls) == 1
    hidden = next(g for g in opt.param_groups if g["rule"] == "hidden")
    hidden["nesterov"] = False
    train(model, opt, 2, gpt_batch, start=4)
    assert len(calls) == 2
    assert all("nesterov" not in p.stages[0] for progs in opt.engine.programs for p in progs if p.rule == "hidden")


SGD = {"geomopt": 1, "name": "sgd", "defaults": {"lr": 0.05}, "rules": [{
    "name": "all", "match": "**", "geometry": {"kind": "euclidean"},
    "direction": {"kind": "heavy_ball", "momentum": 0.9, "dampening": 0.1}}]}
LION = {"geomopt": 1, "name": "lion", "defaults": {"lr": 0.01}, "rules": [{
    "name": "all", "match": "**", "geometry": {"kind": "anisotropic", "reference": {"kind": "indicator"}},
    "direction": {"kind": "lion", "beta1": 0.9, "beta2": 0.99}}]}


@pytest.mark.parametrize("spec, edit", [
    (SGD, {"momentum": 0.5, "dampening": 0.0}),
    (LION, {"beta1": 0.8, "beta2": 0.95}),
    ({**SGD, "rules": [{**SGD["rules"][0], "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}},
                        "match": {"ndim": 2}}, {"name": "rest", "match": "**", "geometry": {"kind": "euclidean"}}]},
     {"momentum": 0.5, "dampening": 0.0}),
], ids=["heavy-ball-flat", "lion-flat", "heavy-ball-batched"])
def test_the_group_is_the_one_source_of_a_directions_coefficients(spec, edit):
    """Editing a direction's coefficient in the group (as a scheduler does) is what the step uses:
    the run equals one built with those values in its spec."""
    edited_spec = copy.deepcopy(spec)
    edited_spec["rules"][0]["direction"].update(edit)
    models = [tiny_mlp(0), tiny_mlp(0)]
    edited = geomopt.GeomOptimizer(models[0], copy.deepcopy(spec))
    edited.param_groups[0].update(edit)
    built = geomopt.GeomOptimizer(models[1], edited_spec)
    assert all(edited.param_groups[0][k] == v for k, v in edit.items())
    for opt, model in zip((edited, built), models):
        train(model, opt, 4, mlp_batch)
    assert params_equal(*models)
    # and the state dict carries them: a fresh optimizer of the old spec resumes the edited values
    again = geomopt.GeomOptimizer(tiny_mlp(0), copy.deepcopy(spec))
    again.load_state_dict(edited.state_dict())
    assert all(again.param_groups[0][k] == v for k, v in edit.items())


def test_a_checkpoint_from_before_groups_held_the_coefficients_loads_with_the_specs():
    model, opt = _opt(SGD, tiny_mlp(0))
    train(model, opt, 2, mlp_batch)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.pop("momentum")
        g.pop("dampening")
    again = geomopt.GeomOptimizer(tiny_mlp(0), SGD)
    again.load_state_dict(sd)
    assert again.param_groups[0]["momentum"] == 0.9 and again.param_groups[0]["dampening"] == 0.1


def test_plan_program_prints_the_programs(capsys):
    code = main(["plan", "muon", "--model", "gpt", "--program"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.startswith("spec 'muon': ") and "variant: batched" in out and "variant: flat" in out
    assert out.count("rule 'hidden'") >= 1 and "why: " in out


def test_plan_program_refuses_a_checkpoint_without_a_traceback(capsys, tmp_path):
    path = tmp_path / "m.pt"
    torch.save(tiny_gpt(0).state_dict(), path)
    code = main(["plan", "muon", "--checkpoint", str(path), "--program"])
    _, err = capsys.readouterr()
    assert code == 2 and "--program needs --model" in err and "Traceback" not in err


def test_describe_is_the_same_after_a_copy_and_a_reload():
    model, opt = _opt("muon")
    train(model, opt, 2, gpt_batch)
    twin = copy.deepcopy(opt)
    assert twin.describe() == opt.describe()
    fresh = geomopt.GeomOptimizer(tiny_gpt(0), "muon")
    fresh.load_state_dict(opt.state_dict())
    assert fresh.describe() == opt.describe()
