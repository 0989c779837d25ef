"""``GeomOptimizer(model, spec, lr=torch.tensor(…))``, as torch.optim takes it: the groups of the
rules that take the default lr hold the tensor, the step reads it (every bit as the float lr of
the same value), schedulers and edits of ``param_groups[i]["lr"]`` keep working, and a checkpoint
saves and restores it."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import gpt_batch, loss_of, tiny_gpt

import geomopt

pytestmark = pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")

SPECS = ["muon", "adamw-hybrid"]


def _steps(model, opt, ks, scheduler=None) -> None:
    for k in ks:
        model.zero_grad(set_to_none=True)
        loss_of(model, gpt_batch(k)).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _bits(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_tensor_lr_steps_every_bit_as_its_float_value(spec, dtype, capturable):
    """float64 0.02 is the float 0.02; a float32 tensor is compared with the float it holds. A
    capturable step reads a tensor lr on the device, in another op order where it scales Adam's
    moment (γ·m, then the division, against the division scaled by γ): its first step agrees
    within float32 rounding (later ones not compared: Adam turns the rounding noise of the near-zero
    gradients of attention's key bias into steps of ±lr)."""
    lr = torch.tensor(0.02, dtype=dtype)
    models = [tiny_gpt(0), tiny_gpt(0)]
    by_float = geomopt.GeomOptimizer(models[0], spec, lr=float(lr), capturable=capturable)
    by_tensor = geomopt.GeomOptimizer(models[1], spec, lr=lr, capturable=capturable)
    assert by_tensor.spec_hash == by_float.spec_hash  # the spec records the value
    rules = {r.name: r for r in by_tensor.spec.rules}
    held = [g["lr"] is lr for g in by_tensor.param_groups]
    assert held == [rules[g["rule"]].lr is None for g in by_tensor.param_groups] and any(held)
    for g in by_tensor.param_groups:
        if g["lr"] is not lr:  # a rule with its own lr keeps its float
            assert isinstance(g["lr"], float) and g["lr"] == rules[g["rule"]].lr
    for k in range(1 if capturable else 4):
        _steps(models[0], by_float, [k])
        _steps(models[1], by_tensor, [k])
        if capturable:
            assert all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(_bits(models[0]), _bits(models[1])))
        else:
            assert _equal(_bits(models[0]), _bits(models[1])), (spec, k)
    assert not _equal(_bits(models[1]), _bits(tiny_gpt(0)))  # it stepped


@pytest.mark.parametrize("spec", SPECS)
def test_a_scheduler_fills_the_tensor_and_the_step_follows(spec):
    """torch's schedulers ``fill_`` a tensor lr in place: the step follows as with a float lr under
    the same schedule; a float set in a group replaces it."""
    lr = torch.tensor(0.02, dtype=torch.float64)
    models = [tiny_gpt(0), tiny_gpt(0)]
    opts = [geomopt.GeomOptimizer(models[0], spec, lr=0.02), geomopt.GeomOptimizer(models[1], spec, lr=lr)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    for k in range(3):
        for m, o, s in zip(models, opts, scheds):
            _steps(m, o, [k], s)
    assert float(lr) == 0.02 * 0.5 ** 3 and any(g["lr"] is lr for g in opts[1].param_groups)
    assert _equal(_bits(models[0]), _bits(models[1]))
    for o in opts:
        o.param_groups[-1]["lr"] = 0.5  # a user's edit of one group
    for m, o in zip(models, opts):
        _steps(m, o, [3])
    assert _equal(_bits(models[0]), _bits(models[1]))


@pytest.mark.parametrize("spec", SPECS)
def test_a_checkpoint_saves_and_restores_a_tensor_lr(spec):
    lr = torch.tensor(0.02, dtype=torch.float64)
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, spec, lr=lr)
    _steps(model, opt, range(2))
    lr.fill_(0.01)  # the groups hold it: the checkpoint saves what the step now reads
    sd = copy.deepcopy(opt.state_dict())
    assert any(torch.is_tensor(g["lr"]) and float(g["lr"]) == 0.01 for g in sd["param_groups"])
    twin = copy.deepcopy(model)
    resumed = geomopt.GeomOptimizer(twin, spec, lr=0.02)  # the same spec: the float of the same value
    resumed.load_state_dict(sd)
    for g, saved in zip(resumed.param_groups, sd["param_groups"]):
        assert type(g["lr"]) is type(saved["lr"]) and float(g["lr"]) == float(saved["lr"])
        assert not torch.is_tensor(g["lr"]) or g["lr"] is not saved["lr"]  # a copy, as torch's loader makes
    _steps(model, opt, [2, 3])
    _steps(twin, resumed, [2, 3])
    assert _equal(_bits(model), _bits(twin))


@pytest.mark.parametrize("lr, message", [
    (torch.tensor([0.01, 0.02]), "1-element"),
    (torch.tensor(1), "floating point"),
    (torch.tensor(float("nan")), "finite"),
    (torch.tensor(-0.1), "> 0"),
])
def test_a_bad_tensor_lr_is_refused_saying_what_to_pass(lr, message):
    with pytest.raises(ValueError, match=message):
        geomopt.GeomOptimizer(tiny_gpt(0), "muon", lr=lr)


def test_a_tensor_weight_decay_is_still_refused():
    with pytest.raises(ValueError, match="weight_decay as a Tensor is not supported"):
        geomopt.GeomOptimizer(tiny_gpt(0), "muon", weight_decay=torch.tensor(0.1))
