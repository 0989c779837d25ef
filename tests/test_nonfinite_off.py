"""``on_nonfinite: off``: the rule's gradients are not read by the finiteness test, so a NaN or ±∞
propagates into its parameters and state exactly as in torch's AdamW (bit for bit against
``AdamW(fused=True)`` and, with ``implementation="foreach"``, against the single-tensor AdamW);
rules that test keep their test, and a step they skip still steps the ``off`` rules; a
capturable step treats ``off`` rules alike (never tested, always stepping)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import geomopt
from optim_helpers import loss_of, mlp_batch, same_snapshot, snapshot, tiny_mlp


def adam_off() -> dict:
    return {"geomopt": 1, "name": "adam-off", "defaults": {"lr": 1e-3, "weight_decay": 0.1, "on_nonfinite": "off"},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "adam"}}]}


def mixed(tested: str = "skip") -> dict:
    """Matrices under a spectral rule that tests; the rest adam, off."""
    return {"geomopt": 1, "name": "mixed", "defaults": {"lr": 1e-3, "weight_decay": 0.1},
            "rules": [{"name": "w", "match": {"ndim": 2},
                       "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}},
                       "direction": {"kind": "polyak", "alpha": 0.05}, "on_nonfinite": tested},
                      {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "on_nonfinite": "off"}]}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32)


def set_grads(model, k: int, bad=None) -> None:
    g = torch.Generator().manual_seed(70 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    if bad is not None:
        name, value = bad
        dict(model.named_parameters())[name].grad.view(-1)[3] = value


@pytest.mark.parametrize("implementation, torch_kw", [("auto", {"fused": True}), ("foreach", {"foreach": False})])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_off_propagates_a_nonfinite_gradient_as_torch_adamw_bit_for_bit(implementation, torch_kw, value):
    model = tiny_mlp(0)
    ref = copy.deepcopy(model)
    opt = geomopt.GeomOptimizer(model, adam_off(), implementation=implementation)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, **torch_kw)
    assert "check off" in opt.describe() and "on_nonfinite: off" in opt.describe()
    assert "finiteness test off" in opt.describe()
    for k in range(4):
        bad = ("layers.0.weight", value) if k == 2 else None
        for m, o in ((model, opt), (ref, torch_opt)):
            set_grads(m, k, bad)
            o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(bits(p), bits(q)), (k, p.dtype)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(bits(opt.state[p][key]), bits(torch_opt.state[q][key])), (k, key)
    w = model.layers[0].weight
    assert not torch.isfinite(w).all() and not torch.isfinite(opt.state[w]["exp_avg_sq"]).all()
    assert opt.diagnostics()["all"]["skipped"] == 0


def test_the_off_rule_steps_when_a_tested_rule_skips():
    """A non-finite gradient of a skip rule skips that rule (every bit as it was, counted) while the
    off rule steps; a non-finite gradient of the off rule alone skips nothing."""
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, mixed())
    for k in range(2):
        set_grads(model, k)
        opt.step()
    text = opt.describe()
    assert "check off" in text and "check before" in text and "finiteness test before any write" in text
    weights = [model.layers[0].weight, model.head.weight]
    biases = [model.layers[0].bias, model.head.bias]
    w_before = [(p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()})
                for p in weights]
    b_before = [p.detach().clone() for p in biases]
    set_grads(model, 2, ("layers.0.weight", math.nan))
    opt.step()
    for p, (x, st) in zip(weights, w_before):
        assert torch.equal(p, x)
        assert all(torch.equal(v, st[k]) if torch.is_tensor(v) else v == st[k] for k, v in opt.state[p].items())
    assert all(not torch.equal(p, x) and torch.isfinite(p).all() for p, x in zip(biases, b_before))
    steps = {g["rule"]: g["step"] for g in opt.param_groups}
    assert steps == {"w": 2, "rest": 3}
    assert opt.diagnostics()["w"]["skipped"] == 1 and opt.diagnostics()["rest"]["skipped"] == 0
    set_grads(model, 3, ("layers.0.bias", math.nan))  # the off rule's NaN: nothing skips
    opt.step()
    assert torch.isfinite(model.layers[0].weight).all() and not torch.isfinite(model.layers[0].bias).all()
    assert {g["rule"]: g["step"] for g in opt.param_groups} == {"w": 3, "rest": 4}
    assert opt.diagnostics()["w"]["skipped"] == 1


def test_raise_still_raises_beside_an_off_rule():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, mixed("raise"))
    set_grads(model, 0)
    opt.step()
    before = snapshot(opt)
    set_grads(model, 1, ("head.weight", math.inf))
    with pytest.raises(geomopt.optim.NonFiniteGradientError):
        opt.step()
    assert same_snapshot(before, snapshot(opt))


def test_a_changed_on_nonfinite_rebuilds_the_programs():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, adam_off())
    assert "check off" in opt.describe()
    opt.param_groups[0]["on_nonfinite"] = "skip"
    assert "check off" not in opt.describe()
    set_grads(model, 0, ("head.bias", math.nan))
    before = snapshot(opt)
    opt.step()
    assert opt.diagnostics()["all"]["skipped"] == 1
    assert same_snapshot(before[:-1], snapshot(opt)[:-1])


@pytest.mark.parametrize("spec", [adam_off(), mixed()], ids=["adam-off", "mixed"])
def test_capturable_off_steps_on_nonfinite_gradients_and_tracks_the_default_step(spec):
    """capturable=True with off rules: allowed; the off rules are not tested and step (NaN
    propagating where the default step propagates it), the tested ones skip on the device."""
    models = [tiny_mlp(0), tiny_mlp(0)]
    plain = geomopt.GeomOptimizer(models[0], spec)
    captured = geomopt.GeomOptimizer(models[1], spec, capturable=True)
    for k in range(4):
        for m, o in zip(models, (plain, captured)):
            set_grads(m, k, ("layers.0.bias", math.nan) if k == 2 else ("layers.0.weight", math.nan) if k == 3
                      else None)
            o.step()
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(torch.isfinite(p), torch.isfinite(q))
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6, equal_nan=True)
    for gp, gc in zip(plain.param_groups, captured.param_groups):
        assert int(gc["step"]) == gp["step"]
    assert [int(c["skipped"]) for c in captured.engine.counters] == [c["skipped"] for c in plain.engine.counters]
    if spec["name"] == "mixed":
        assert [c["skipped"] for c in plain.engine.counters] == [1, 0]


def test_mlp_batch_loss_is_nan_after_an_off_step_as_in_torch():
    """End to end: a NaN gradient under off reaches the loss, as it would with torch's AdamW."""
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, adam_off())
    set_grads(model, 0, ("head.weight", math.nan))
    opt.step()
    assert math.isnan(loss_of(model, mlp_batch(0)).item())


EXACT = {"svd": ({"kind": "svd"}, None), "gram_eigh": ({"kind": "gram_eigh"}, None),
         "spectral_ball": ({"kind": "newton_schulz"}, {"kind": "spectral_ball", "radius": 3.0, "method": "exact"}),
         "frobenius_ball": ({"kind": "svd"}, {"kind": "frobenius_ball", "radius": 3.0})}


@pytest.mark.parametrize("case", list(EXACT))
def test_off_propagates_a_nan_through_an_exact_decomposition(case):
    """An exact SVD or eigh (the geometry's approximation, a spectral constraint's step) on a NaN
    gradient of an ``off`` rule: the step goes on (no LAPACK error, nothing applied in part), the
    NaN reaches that tensor's parameter and momentum as in torch, and the bucket's other tensor
    steps bit for bit as beside a finite gradient."""
    approx, constraint = EXACT[case]
    rule = {"name": "w", "match": "**", "on_nonfinite": "off", "direction": {"kind": "polyak", "alpha": 0.1},
            "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
                         "approx": approx}}
    if constraint:
        rule["constraint"] = constraint
    spec = {"geomopt": 1, "name": "exact-off", "defaults": {"lr": 0.05}, "rules": [rule]}
    runs = []
    for value in (math.nan, 0.0):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for _ in range(2)]
        opt = geomopt.GeomOptimizer([("a", params[0]), ("b", params[1])], spec)
        for k in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if k == 1:
                params[0].grad[2, 1] = value
            opt.step()
        runs.append((params, opt))
    (a, b), opt = runs[0]
    assert a.isnan().all() and torch.equal(bits(b), bits(runs[1][0][1]))
    assert any(torch.is_tensor(v) and v.is_floating_point() and v.isnan().any() for v in opt.state[a].values())
    assert all(torch.isfinite(v).all() for v in opt.state[b].values() if torch.is_tensor(v) and v.is_floating_point())
