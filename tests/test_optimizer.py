"""GeomOptimizer as a torch.optim.Optimizer: groups and schedulers, the per-tensor step, directions,
schedules, diagnostics, feasibility, non-finite gradients, dtypes/devices, tied/frozen/absent
gradients, torch.compile, spec/model mismatch, and training every shipped spec."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch import nn

import geomopt
from geomopt.optim import NonFiniteGradientError
from optim_helpers import (
    DEVICES, SHIPPED, SPECS, gpt_batch, loss_of, mlp_batch, same_snapshot, snapshot, tiny_gpt, tiny_mlp, train,
)


def one_rule(geometry: dict, *, constraint=None, match="**", **hyper) -> dict:
    rule = {"name": "all", "match": match, "geometry": geometry, **hyper}
    if constraint is not None:
        rule["constraint"] = constraint
    return {"geomopt": 1, "name": "test", "rules": [rule]}


EUCLID = {"kind": "euclidean"}
SIGN = {"kind": "anisotropic", "reference": {"kind": "indicator"}}


class Vec(nn.Module):
    """One parameter vector x; loss ½‖x − ξ‖² has gradient x − ξ (known in closed form)."""

    def __init__(self, n=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.x = nn.Parameter(torch.randn(n, dtype=torch.float64))


def set_grad(model, g):
    model.x.grad = g.clone()


# ---------------------------------------------------------------- groups, step, schedulers


def test_one_param_group_per_rule_with_scalars():
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, SPECS / "scion.yaml")
    assert [g["rule"] for g in opt.param_groups] == ["embeddings", "head", "hidden", "rest"]
    by_rule = {g["rule"]: g for g in opt.param_groups}
    assert by_rule["head"]["radius"] == 10.0 and by_rule["hidden"]["radius"] == 1.0
    for g in opt.param_groups:
        assert g["lr"] == 0.02 and g["weight_decay"] == 1.0 and g["alpha"] == pytest.approx(0.1)
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    # accepts a Spec, a path and a dict alike
    spec = geomopt.load_spec(SPECS / "scion.yaml")
    for s in (spec, str(SPECS / "scion.yaml"), spec.model_dump()):
        assert [g["rule"] for g in geomopt.GeomOptimizer(tiny_gpt(0), s).param_groups] == [
            "embeddings", "head", "hidden", "rest"]
    # and named parameters instead of a module
    opt2 = geomopt.GeomOptimizer(list(tiny_mlp(0).named_parameters()), SPECS / "sign-descent.yaml")
    assert len(opt2.param_groups[0]["params"]) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_step_is_decay_then_forward_then_backward(device):
    """X⁺ = P_C(X(1 − γ·wd) − γ·ρ·∇φ₁*(d)), checked in closed form: euclidean with a Frobenius
    ball (P_C is a rescale) and sign with a radius."""
    torch.manual_seed(0)
    x0 = torch.randn(6, 4, device=device)
    g = torch.randn(6, 4, device=device)
    lr, wd = 0.1, 0.3
    for geometry, constraint, expect in [
        ({**EUCLID, "radius": 2.0}, None, lambda: x0 * (1 - lr * wd) - lr * 2.0 * g),
        ({**SIGN, "radius": 0.5}, None, lambda: x0 * (1 - lr * wd) - lr * 0.5 * torch.sign(g)),
        (EUCLID, {"kind": "frobenius_ball", "radius": 1.0},
         lambda: (lambda y: y / max(1.0, float(y.norm())))(x0 / max(1.0, float(x0.norm())) * (1 - lr * wd) - lr * g)),
    ]:
        p = nn.Parameter(x0.clone())
        opt = geomopt.GeomOptimizer([("w", p)], one_rule(geometry, constraint=constraint, lr=lr, weight_decay=wd))
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), expect(), rtol=1e-6, atol=1e-7)


def test_lr_schedulers_drive_the_step():
    """LambdaLR and CosineAnnealingLR change group lr; the sign step moves exactly lr·ρ per entry."""
    p = nn.Parameter(torch.zeros(8))
    opt = geomopt.GeomOptimizer([("w", p)], one_rule(SIGN, lr=0.25))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
    for k in range(4):
        before = p.detach().clone()
        p.grad = torch.ones(8)
        opt.step()
        sched.step()
        assert torch.equal(before - p.detach(), torch.full((8,), 0.25 * 0.5**k))
    q = nn.Parameter(torch.zeros(3))
    opt = geomopt.GeomOptimizer([("w", q)], one_rule(SIGN, lr=1.0))
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    moves = []
    for _ in range(4):
        before = q.detach().clone()
        q.grad = -torch.ones(3)
        opt.step()
        cos.step()
        moves.append(float((q.detach() - before)[0]))
    expected = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert moves == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- directions


def run_fixed_grads(spec: dict, grads: list[torch.Tensor], x0: torch.Tensor) -> list[torch.Tensor]:
    p = nn.Parameter(x0.clone())
    opt = geomopt.GeomOptimizer([("w", p)], spec)
    xs = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        xs.append(p.detach().clone())
    return xs


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("init", ["zero", "gradient"])
def test_polyak_direction(nesterov, init):
    torch.manual_seed(0)
    x0 = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    a, lr = 0.3, 0.1
    xs = run_fixed_grads(one_rule(EUCLID, lr=lr, direction={"kind": "polyak", "alpha": a, "nesterov": nesterov,
                                                             "init": init}), grads, x0)
    x, d = x0.clone(), None
    for g, got in zip(grads, xs):
        if d is None:
            d = g.clone() if init == "gradient" else a * g  # d⁰ = g⁰, or 0 then one update
        else:
            d = a * g + (1 - a) * d
        step = g + (1 - a) * (d - g) if nesterov else d
        x = x - lr * step
        torch.testing.assert_close(got, x, rtol=1e-12, atol=1e-12)


def test_storm_direction_and_closure_protocol():
    """d⁰ = g(x₀, ξ₀) with one evaluation; then d ← g(x_k, ξ_k) + (1−α)(d − g(x_{k−1}, ξ_k)), both
    on batch ξ_k (the closure is evaluated twice per step)."""
    model = Vec()
    a, lr = 0.4, 0.2
    opt = geomopt.GeomOptimizer(model, one_rule(EUCLID, lr=lr, direction={"kind": "storm", "alpha": a}))
    p = model.x
    with pytest.raises(RuntimeError, match="closure"):
        p.grad = torch.ones_like(p)
        opt.step()
    assert opt.state[p] == {}  # the refused step touched nothing
    xis = [torch.randn(5, dtype=torch.float64) for _ in range(5)]
    calls, seen = [], []

    def make_closure(xi):
        def closure():
            calls.append(1)
            seen.append(p.detach().clone())
            loss = 0.5 * (p - xi).square().sum()  # no zero_grad here on purpose: the optimizer zeroes
            loss.backward()
            return loss
        return closure

    x, x_prev, d = p.detach().clone(), None, None
    for k, xi in enumerate(xis):
        n_before = len(calls)
        loss = opt.step(make_closure(xi))
        assert len(calls) - n_before == (1 if k == 0 else 2)
        if k == 0:
            d = x - xi
        else:
            assert torch.equal(seen[-2], x_prev_iter) and torch.equal(seen[-1], x)
            d = (x - xi) + (1 - a) * (d - (x_prev_iter - xi))
        assert float(loss.detach()) == pytest.approx(float(0.5 * (x - xi).square().sum()))
        x_prev_iter = x
        x = x - lr * d
        torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-12)


def test_storm_schedule_and_theory_schedule():
    """storm: α_k = γ_k = lr·(k+1)^(−2/3); theory: γ = lr·γ̄(K+1)^(−3/4), α = (K+1)^(−1/2)."""
    model = Vec(seed=1)
    lr = 0.5
    opt = geomopt.GeomOptimizer(model, one_rule(EUCLID, lr=lr, direction={"kind": "storm"}, schedule={"kind": "storm"}))
    p = model.x
    xis = [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    x, d, x_prev = p.detach().clone(), None, None
    for k, xi in enumerate(xis):
        def closure(xi=xi):
            opt.zero_grad()
            (0.5 * (p - xi).square().sum()).backward()
        opt.step(closure)
        ak = (k + 1) ** (-2 / 3)
        d = (x - xi) if d is None else (x - xi) + (1 - ak) * (d - (x_prev - xi))
        x_prev, x = x, x - lr * ak * d
        torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-12)

    torch.manual_seed(2)
    x0 = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    K, gbar = 99, 0.7
    xs = run_fixed_grads(one_rule(EUCLID, lr=2.0, direction={"kind": "polyak", "alpha": 0.9},
                                  schedule={"kind": "theory", "horizon": K, "gamma_bar": gbar}), grads, x0)
    gamma, alpha = 2.0 * gbar * (K + 1) ** -0.75, (K + 1) ** -0.5
    x, d = x0.clone(), torch.zeros(5, dtype=torch.float64)
    for g, got in zip(grads, xs):
        d = alpha * g + (1 - alpha) * d  # the schedule's α replaces the spec's 0.9
        x = x - gamma * d
        torch.testing.assert_close(got, x, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- diagnostics, feasibility


def test_update_norm_is_opt_in():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, one_rule({"kind": "euclidean"}))
    loss_of(model, mlp_batch(0)).backward()
    opt.step()
    assert opt.diagnostics()["all"]["update_norm"] is None


def test_diagnostics_gap_violation_update_norm():
    spec = one_rule({"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.05},
                     "approx": {"kind": "svd"}},
                    constraint={"kind": "frobenius_ball", "radius": 1.0}, lr=0.05,
                    match={"name": "**.weight", "ndim": 2})
    spec["rules"].append({"name": "rest", "match": "**", "geometry": {"kind": "isotropic",
                                                                     "reference": {"kind": "log_barrier"}}})
    model = tiny_mlp(0)
    batch = mlp_batch(0)
    for track in (False, True):
        m = copy.deepcopy(model)
        opt = geomopt.GeomOptimizer(m, spec, track_gap=track, track_update=True)
        gaps = []
        for _ in range(4):
            before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
            opt.zero_grad()
            loss_of(m, batch).backward()
            diag = opt.diagnostics()  # W of the last step paired with the gradient at X⁺
            gaps.append(diag["all"]["gap"])
            opt.step()
            moved = math.sqrt(sum(float((p.detach() - b).square().sum()) for p, b in zip(opt.param_groups[0]["params"], before)))
            diag = opt.diagnostics()
            assert diag["all"]["update_norm"] == pytest.approx(moved, rel=1e-5)
            assert diag["all"]["violation"] <= 1e-5
            for p in opt.param_groups[0]["params"]:
                assert float(p.detach().norm()) <= 1.0 + 1e-5
            assert diag["all"]["skipped"] == 0 and diag["all"]["fallbacks"] == 0
            assert diag["rest"]["dual_norm"] is not None and diag["rest"]["dual_norm"] > 0
        assert gaps[0] is None  # no W before the first step
        if track:
            assert all(g is not None and math.isfinite(g) and g >= 0 for g in gaps[1:])
        else:
            assert all(g is None for g in gaps)


def test_infeasible_step_falls_back_and_is_counted():
    """Without project_on_init a point far outside the ball makes the barrier step undefined
    (C misses Y + t·dom φ₁): the Euclidean projection is used and counted."""
    p = nn.Parameter(torch.full((4, 4), 5.0))
    spec = one_rule({"kind": "isotropic", "reference": {"kind": "log_barrier", "eps": 1e-3}},
                    constraint={"kind": "frobenius_ball", "radius": 1.0}, lr=0.01, project_on_init=False)
    opt = geomopt.GeomOptimizer([("w", p)], spec)
    assert torch.equal(p.detach(), torch.full((4, 4), 5.0))  # not projected
    assert opt.diagnostics()["all"]["violation"] == pytest.approx(20.0 - 1.0, rel=1e-6)
    p.grad = torch.ones(4, 4)
    opt.step()
    assert float(p.detach().norm()) == pytest.approx(1.0, rel=1e-6)
    d = opt.diagnostics()["all"]
    assert d["fallbacks"] == 1 and d["violation"] <= 1e-6


def test_project_on_init():
    torch.manual_seed(0)
    w = torch.randn(6, 3) * 3
    for on in (True, False):
        p = nn.Parameter(w.clone())
        geomopt.GeomOptimizer([("w", p)], one_rule(
            {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}},
            constraint={"kind": "stiefel", "radius": 2.0}, project_on_init=on))
        s = torch.linalg.svdvals(p.detach())
        if on:
            torch.testing.assert_close(s, torch.full((3,), 2.0), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(p.detach(), w)


def test_project_on_init_respects_view_blocks():
    """A fused (3·d, d) weight with ``view: {blocks: 3}`` is three matrices: each block goes onto
    the set."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(12, 4) * 3)
    geomopt.GeomOptimizer([("w", p)], one_rule(
        {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"},
         "view": {"kind": "matrix", "blocks": 3}},
        constraint={"kind": "stiefel", "radius": 1.0}))
    for block in p.detach().split(4):
        torch.testing.assert_close(torch.linalg.svdvals(block), torch.ones(4), rtol=1e-5, atol=1e-5)


def _set_distance(kind: str, x: torch.Tensor, r: float) -> float:
    """Distance to the set, computed here from its definition (not through geomopt)."""
    s = torch.linalg.svdvals(x.reshape(x.shape[0], -1).double())
    if kind == "spectral_ball":
        return float((s - r).clamp(min=0).norm())
    if kind == "stiefel":
        return float((s - r).norm())
    if kind == "frobenius_ball":
        return max(0.0, float(s.norm()) - r)
    if kind == "frobenius_sphere":
        return abs(float(s.norm()) - r)
    raise ValueError(kind)


CONSTRAINED = ["spectral-clip", "stiefel", "hyperball", "prox-muon-frobenius"]


@pytest.mark.parametrize("name", CONSTRAINED)
def test_constrained_specs_stay_feasible_every_step(name):
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, SPECS / f"{name}.yaml")
    constrained = [(p, opt.plan[n]) for n, p in model.named_parameters() if opt.plan[n].rule == "hidden"]
    assert constrained and all(pp.constraint is not None for _, pp in constrained)
    batch = mlp_batch(0)
    for k in range(6):
        for p, pp in constrained:
            c = pp.constraint
            assert _set_distance(c["kind"], p.detach(), c["radius"]) <= 1e-4 * max(1.0, c["radius"]), (k, pp.name)
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    assert opt.diagnostics()["hidden"]["violation"] <= 1e-4


# ---------------------------------------------------------------- non-finite gradients


def _two_rule_spec(on_nonfinite_hidden=None, default="skip"):
    hidden = {"name": "hidden", "match": {"name": "layers.*.weight"},
              "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}},
              "direction": {"kind": "polyak", "alpha": 0.1}}
    if on_nonfinite_hidden:
        hidden["on_nonfinite"] = on_nonfinite_hidden
    return {"geomopt": 1, "name": "nf", "defaults": {"on_nonfinite": default},
            "rules": [{"name": "first", "match": "head.*", "geometry": {"kind": "adam"}}, hidden,
                      {"name": "rest", "match": "**", "geometry": SIGN}]}


def _forms(form, monkeypatch):
    """``cuda``: run CUDA's forms here (:func:`geomopt.geometry.polynomial.muon_order` false), where
    the finiteness test is awaited after the forward ops are launched (deferred)."""
    if form == "cuda":
        import geomopt.geometry.polynomial as spectral_module

        monkeypatch.setattr(spectral_module, "_MUON_ORDER_DEVICES", ())


@pytest.mark.parametrize("form", ["cpu", "cuda"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_skip_leaves_everything_untouched(bad, form, monkeypatch):
    _forms(form, monkeypatch)
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, _two_rule_spec())
    train(model, opt, 2, mlp_batch)
    before = snapshot(opt)
    opt.zero_grad()
    loss_of(model, mlp_batch(5)).backward()
    model.layers[0].weight.grad[1, 2] = bad  # one entry of one tensor of the middle rule
    opt.step()
    assert same_snapshot(before, snapshot(opt))
    diag = opt.diagnostics()
    assert diag["hidden"]["skipped"] == 1 and diag["first"]["skipped"] == 0
    train(model, opt, 1, mlp_batch, start=6)  # and it goes on normally
    assert not same_snapshot(before, snapshot(opt))
    assert opt.diagnostics()["hidden"]["skipped"] == 1


@pytest.mark.parametrize("form", ["cpu", "cuda"])
@pytest.mark.parametrize("where", ["default", "rule"])
def test_nonfinite_raise_before_anything_is_written(where, form, monkeypatch):
    _forms(form, monkeypatch)
    spec = _two_rule_spec(default="raise") if where == "default" else _two_rule_spec(on_nonfinite_hidden="raise")
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, spec)
    train(model, opt, 1, mlp_batch)
    before = snapshot(opt)
    opt.zero_grad()
    loss_of(model, mlp_batch(3)).backward()
    model.layers[0].weight.grad[0, 0] = math.nan
    with pytest.raises(NonFiniteGradientError, match="layers.0.weight"):
        opt.step()
    # the rule before it ("first", finite) must not have stepped either
    assert same_snapshot(before, snapshot(opt))


@pytest.mark.parametrize("form", ["cpu", "cuda"])
def test_finiteness_is_awaited_after_the_forward_ops_where_deferred(form, monkeypatch):
    """CUDA's form launches every bucket's forward op (reads into scratch) before the host waits
    for the finiteness test, and writes nothing before it; the CPU form tests first."""
    import geomopt.optim.engine.requests as optimizer_module
    import geomopt.optim.engine.engine as optimizer

    _forms(form, monkeypatch)
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, _two_rule_spec())
    train(model, opt, 1, mlp_batch)
    order = []
    real_forward, real_skip = optimizer_module.forward, optimizer.skip_nonfinite
    monkeypatch.setattr(optimizer_module, "forward", lambda *a, **k: order.append("forward") or real_forward(*a, **k))
    monkeypatch.setattr(optimizer, "skip_nonfinite", lambda *a: order.append("check") or real_skip(*a))
    train(model, opt, 1, mlp_batch, start=1)
    assert order.count("check") == 1 and order.count("forward") >= 1
    assert order.index("check") == (order.index("forward") + order.count("forward") if form == "cuda" else 0)


# ---------------------------------------------------------------- dtypes, devices, model shapes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_and_devices(device, dtype):
    model = tiny_mlp(0, device=device, dtype=dtype)
    opt = geomopt.GeomOptimizer(model, SPECS / "muon.yaml")
    losses = train(model, opt, 15, lambda k: mlp_batch(0, device=device, dtype=dtype))
    assert losses[-1] < losses[0]
    for group in opt.param_groups:
        for p in group["params"]:
            assert p.dtype == dtype and p.device.type == device
            for k, v in opt.state[p].items():
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                    assert v.dtype == torch.float32, (group["rule"], k)
                    assert v.device.type == device


def test_bf16_parameters_follow_the_fp32_update_rounded():
    """bf16 parameters: the step is computed in fp32 from the bf16 value and rounded once."""
    torch.manual_seed(0)
    x32 = torch.randn(16).bfloat16().float()
    g = torch.randn(16)
    p = nn.Parameter(x32.bfloat16())
    opt = geomopt.GeomOptimizer([("w", p)], one_rule(EUCLID, lr=0.1, weight_decay=0.5))
    p.grad = g.bfloat16()
    opt.step()
    expect = (x32 * (1 - 0.05) - 0.1 * g.bfloat16().float()).bfloat16()
    assert torch.equal(p.detach(), expect)


def test_tied_weights_are_updated_once():
    model = tiny_gpt(0, tie_weights=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = geomopt.GeomOptimizer(model, one_rule(SIGN, lr=0.01))
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    tied = model.lm_head.weight
    before = tied.detach().clone()
    opt.zero_grad()
    loss_of(model, gpt_batch(0)).backward()
    g = tied.grad.clone()
    opt.step()
    assert torch.equal(tied.detach(), before - 0.01 * torch.sign(g))  # one step, not two
    assert opt.plan["lm_head.weight"].name == "transformer.wte.weight"


def test_frozen_and_gradless_parameters_are_left_alone():
    model = tiny_mlp(0, depth=3)
    model.layers[0].weight.requires_grad_(False)
    opt = geomopt.GeomOptimizer(model, SPECS / "uscion.yaml")
    assert all(p is not model.layers[0].weight for g in opt.param_groups for p in g["params"])
    frozen = model.layers[0].weight.detach().clone()
    train(model, opt, 2, mlp_batch)
    assert torch.equal(model.layers[0].weight, frozen)
    # a parameter without a gradient this step: neither it nor its state moves
    opt.zero_grad()
    loss_of(model, mlp_batch(9)).backward()
    model.layers[1].bias.grad = None
    p = model.layers[1].bias
    x, d = p.detach().clone(), opt.state[p]["d"].clone()
    others = model.head.weight.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), x) and torch.equal(opt.state[p]["d"], d)
    assert not torch.equal(model.head.weight, others)


def test_zero_grad():
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, SPECS / "sign-descent.yaml")
    loss_of(model, mlp_batch(0)).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    loss_of(model, mlp_batch(0)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    x = [p.detach().clone() for p in model.parameters()]
    opt.step()  # zero gradients: sign(0) = 0, nothing moves
    assert all(torch.equal(a, b) for a, b in zip(x, model.parameters()))


# ---------------------------------------------------------------- torch.compile


def test_compiled_loss_with_eager_step_matches_eager():
    import torch._dynamo

    torch._dynamo.reset()
    eager, compiled = tiny_gpt(0), tiny_gpt(0)
    opt_e = geomopt.GeomOptimizer(eager, SPECS / "uscion.yaml")
    opt_c = geomopt.GeomOptimizer(compiled, SPECS / "uscion.yaml")
    loss_fn = torch.compile(lambda m, idx, tgt: m(idx, tgt)[1], backend="eager")
    batch = gpt_batch(0)
    for _ in range(3):
        for m, o, f in ((eager, opt_e, lambda m, i, t: m(i, t)[1]), (compiled, opt_c, loss_fn)):
            o.zero_grad()
            f(m, *batch).backward()
            o.step()
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_whole_training_step():
    """torch.compile of a function doing forward, backward and opt.step() (graph breaks are fine):
    same iterates as eager."""
    import torch._dynamo

    torch._dynamo.reset()
    eager, compiled = tiny_mlp(0), tiny_mlp(0)
    opt_e = geomopt.GeomOptimizer(eager, SPECS / "muon.yaml")
    opt_c = geomopt.GeomOptimizer(compiled, SPECS / "muon.yaml")
    batch = mlp_batch(0)

    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step_c = torch.compile(train_step, backend="eager")
    t0 = time.perf_counter()
    for _ in range(3):
        train_step(eager, opt_e, *batch)
        step_c(compiled, opt_c, *batch)
    assert time.perf_counter() - t0 < 120
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- spec / model mismatch


def test_mismatch_raises_spec_error_naming_params_and_nearest_patterns():
    spec = {"geomopt": 1, "name": "partial", "rules": [
        {"name": "hidden", "match": "layers.*.weight", "geometry": SIGN},
        {"name": "head", "match": "head.weight", "geometry": SIGN}]}
    with pytest.raises(geomopt.SpecError) as err:
        geomopt.GeomOptimizer(tiny_mlp(0), spec)
    text = str(err.value)
    assert "layers.0.bias" in text and "head.bias" in text
    assert "layers.*.weight" in text or "head.weight" in text  # nearest rule patterns
    assert any(d.code == "GO101" for d in err.value.diagnostics)


# ---------------------------------------------------------------- every shipped spec trains


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_spec_lowers_the_loss(path):
    model = tiny_mlp(0)
    opt = geomopt.GeomOptimizer(model, path)
    losses = train(model, opt, 30, lambda k: mlp_batch(0))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0], (path.stem, losses[0], losses[-1])


# ---------------------------------------------------------------- functional API = optimizer step


@pytest.mark.parametrize("geometry, constraint", [
    ({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}, "scale": "muon_original"},
     None),
    ({"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 0.01}, "approx": {"kind": "svd"},
      "scale": "scion"}, {"kind": "frobenius_ball", "radius": 0.5, "relative": True}),
    ({"kind": "anisotropic", "reference": {"kind": "log_barrier", "eps": 0.1}, "scale": "scion", "radius": 3.0},
     {"kind": "linf_ball", "radius": 0.2}),
    ({"kind": "rowwise", "reference": {"kind": "log_barrier"}, "scale": "scion"}, None),
])
def test_functional_api_is_the_optimizer_step(geometry, constraint):
    """X⁺ = backward_step(X − γ·forward_step(g), γ) with ρ resolved (scale preset, relative
    radius) as the optimizer does."""
    torch.manual_seed(0)
    x0 = torch.randn(8, 2, dtype=torch.float64) * 0.1
    g = torch.randn(8, 2, dtype=torch.float64)
    lr = 0.05
    p = nn.Parameter(x0.clone())
    opt = geomopt.GeomOptimizer([("w", p)], one_rule(geometry, constraint=constraint, lr=lr))
    x = p.detach().clone()  # after project_on_init
    p.grad = g.clone()
    opt.step()
    y = x - lr * geomopt.forward_step(g, geometry)
    expect = geomopt.backward_step(y, lr, geometry, constraint) if constraint else y
    torch.testing.assert_close(p.detach(), expect, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(p.detach(), x)


def test_add_param_group_is_refused_with_a_pointer_to_the_spec():
    model = torch.nn.Linear(4, 4)
    opt = geomopt.GeomOptimizer(model, SPECS / "normalized-sgd.yaml")
    with pytest.raises(RuntimeError, match="add a rule to the spec"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1


def test_unnamed_parameters_get_a_warning_that_says_how_to_name_them():
    """model.parameters() is accepted (torch's contract; tests/test_torch_contract.py), with a
    warning that names are generated and roles guessed."""
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="named_parameters"):
        opt = geomopt.GeomOptimizer(model.parameters(), SPECS / "normalized-sgd.yaml")
    assert [n for g in opt.param_groups for n in g["param_names"]] == ["param.0", "param.1"]


def test_stiefel_polar_recovers_from_an_infeasible_start():
    """method: polar counts its steps for Y near Stiefel(r); from a Gaussian init without
    project_on_init the first step is flagged and lands near the manifold, the second on it."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 32))
    spec = {"geomopt": 1, "name": "t", "defaults": {"lr": 0.02, "project_on_init": False}, "rules": [{
        "name": "w", "match": "**",
        "geometry": {"kind": "spectral", "reference": {"kind": "power_barrier", "kappa": 4.0, "eps": 2e-3},
                     "approx": {"kind": "newton_schulz"}},
        "constraint": {"kind": "stiefel", "radius": 1.0, "method": "polar"}}]}
    opt = geomopt.GeomOptimizer([("w", w)], spec)
    deviation = []
    for _ in range(3):
        w.grad = torch.randn(64, 32)
        opt.step()
        deviation.append(float((w.detach().T @ w.detach() - torch.eye(32)).abs().max()))
    assert opt.diagnostics()["w"]["fallbacks"] >= 1  # the first step was flagged
    assert deviation[0] < 0.5 and deviation[1] < 2e-6 and deviation[2] < 2e-6


@pytest.mark.parametrize("constraint", [{"kind": "stiefel", "radius": 1.0}, {"kind": "spectral_ball", "radius": 1.0},
                                        {"kind": "frobenius_sphere", "radius": 2.0}])
def test_project_on_init_keeps_a_feasible_tensor_bit_for_bit(constraint):
    """Projecting on init leaves a tensor already in the set untouched (a re-projection would move
    its low bits: an SVD reconstruction), and still projects one just outside it."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(12, 8) * 3)
    spec = one_rule({"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "svd"}}, constraint=constraint)
    geomopt.GeomOptimizer([("w", p)], spec)  # onto the set
    feasible = p.detach().clone()
    geomopt.GeomOptimizer([("w", p)], spec)
    assert torch.equal(p.detach(), feasible)
    with torch.no_grad():
        p.mul_(1.001)  # 0.1% outside: far beyond rounding
    geomopt.GeomOptimizer([("w", p)], spec)
    torch.testing.assert_close(p.detach(), feasible, rtol=1e-5, atol=1e-6)
    assert not torch.equal(p.detach(), feasible * 1.001)
