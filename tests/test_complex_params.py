"""Complex parameters: stepped where the rule is elementwise (the flat path, through real views as
torch.optim does), refused at construction elsewhere, naming the tensor, its rule and what to do."""

from __future__ import annotations

import pytest
import torch

import geomopt

TORCH = {
    # torch's reference for each shipped spec (its catalogue entry's own reference settings)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
}


def complex_pair(dtype=torch.complex64):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(6, dtype=dtype, generator=g).requires_grad_()
    return w, b


def twins(ps):
    return [p.detach().clone().requires_grad_() for p in ps]


def set_grads(groups: list, k: int) -> None:
    """The same complex gradient on every tensor at the same position of each list (a real view
    gets the complex gradient's real view)."""
    g = torch.Generator().manual_seed(100 + k)
    for ps in zip(*groups):
        grad = torch.randn(ps[0].shape, dtype=ps[0].dtype, generator=g)
        for p in ps:
            p.grad = grad.clone() if p.is_complex() == grad.is_complex() else torch.view_as_real(grad).clone()


def named(ps):
    return [(n, p) for n, p in zip(("weight", "bias"), ps)]


@pytest.mark.parametrize("spec", ["adamw", "sgd-momentum", "sign-descent", "normalized-sgd"])
@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_a_complex_parameter_steps_as_its_real_view_bit_for_bit(spec, implementation):
    """ℂⁿ ≅ ℝ²ⁿ: the complex run equals the run on view_as_real copies (as real parameters), every
    bit, parameters and state."""
    cs = complex_pair()
    rs = [torch.view_as_real(p.detach()).clone().requires_grad_() for p in cs]
    oc = geomopt.GeomOptimizer(named(cs), spec, implementation=implementation)
    orr = geomopt.GeomOptimizer(named(rs), spec, implementation=implementation)
    for k in range(4):
        set_grads([cs, rs], k)
        oc.step()
        orr.step()
    for c, r in zip(cs, rs):
        assert torch.equal(torch.view_as_real(c.detach()), r.detach())
        assert oc.state[c].keys() == orr.state[r].keys() and oc.state[c]
        for key, v in oc.state[c].items():
            if key == "adam_step":  # the count: a 0-dim int64 tensor, as for a real parameter
                assert v.dtype == torch.int64 and v.shape == () and torch.equal(v, orr.state[r][key])
            elif isinstance(v, torch.Tensor):
                assert v.dtype == c.dtype and v.shape == c.shape, key  # complex like the parameter (torch's form)
                assert torch.equal(torch.view_as_real(v), orr.state[r][key]), key
    assert not torch.equal(cs[0].detach(), complex_pair()[0].detach())  # it moved


def test_complex_adamw_matches_torch_adamw_bit_for_bit():
    """Unfused: torch's AdamW on the complex tensors (its single-tensor loop views them as real).
    Fused (geomopt's default on CPU): torch refuses complex tensors under fused=True, so its fused
    AdamW runs on the real views."""
    for dtype in (torch.complex64, torch.complex128):
        for fused in (True, False):
            cs = complex_pair(dtype)
            ts = [torch.view_as_real(p.detach()).clone().requires_grad_() for p in cs] if fused else twins(cs)
            opt = geomopt.GeomOptimizer(named(cs), "adamw", implementation="auto" if fused else "foreach")
            ref = torch.optim.AdamW(ts, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                    **(dict(fused=True) if fused else dict(foreach=False)))
            for k in range(5):
                set_grads([cs, ts], k)
                opt.step()
                ref.step()
            for c, t in zip(cs, ts):
                assert torch.equal(c if not fused else torch.view_as_real(c), t), (dtype, fused)
                v = opt.state[c]["exp_avg_sq"]
                assert torch.equal(v if not fused else torch.view_as_real(v), ref.state[t]["exp_avg_sq"])


def test_complex_sgd_momentum_matches_torch_sgd():
    """torch.optim.SGD steps a complex tensor with complex arithmetic, which rounds a product by a
    real scalar as (a·μ − b·0) and can differ from the real product in the last bit (its fused
    multiply-adds): geomopt equals torch's SGD on the real views bit for bit, and torch's SGD on
    the complex tensors within 4 float32 ulps of the entries' size."""
    cs = complex_pair()
    ts = twins(cs)
    rs = [torch.view_as_real(p.detach()).clone().requires_grad_() for p in cs]
    opt = geomopt.GeomOptimizer(named(cs), "sgd-momentum")
    on_complex, on_real = TORCH["sgd-momentum"](ts), TORCH["sgd-momentum"](rs)
    for k in range(5):
        set_grads([cs, ts, rs], k)
        for o in (opt, on_complex, on_real):
            o.step()
    for c, t, r in zip(cs, ts, rs):
        assert torch.equal(torch.view_as_real(c.detach()), r.detach())
        torch.testing.assert_close(c.detach(), t.detach(), rtol=0, atol=4 * torch.finfo(torch.float32).eps * 4)


@pytest.mark.parametrize("spec, rule", [("muon", "hidden"), ("stiefel", None), ("hyperball", None)])
def test_complex_parameters_are_refused_where_the_rule_is_not_elementwise(spec, rule):
    w, b = complex_pair()
    before = w.detach().clone()
    with pytest.raises(ValueError) as info:
        geomopt.GeomOptimizer(named([w, b]), spec)
    text = str(info.value)
    assert "'weight'" in text and "complex" in text and "view_as_real" in text and "rule '" in text
    if rule is not None:
        assert f"rule '{rule}'" in text
    assert torch.equal(w.detach(), before)  # nothing projected or written


def test_tracking_refuses_complex_parameters_and_low_precision_complex_is_refused():
    w, b = complex_pair()
    with pytest.raises(ValueError, match="track_gap"):
        geomopt.GeomOptimizer(named([w, b]), "adamw", track_gap=True)
    half = torch.zeros(4, dtype=torch.complex32, requires_grad=True)
    with pytest.raises(ValueError, match="complex64 and complex128"):
        geomopt.GeomOptimizer([("z", half)], "adamw")


def test_a_complex_checkpoint_resumes_bit_for_bit():
    cs, cs2 = complex_pair(), complex_pair()
    opt, opt2 = geomopt.GeomOptimizer(named(cs), "adamw"), geomopt.GeomOptimizer(named(cs2), "adamw")
    for k in range(2):
        set_grads([cs, cs2], k)
        opt.step()
        opt2.step()
    fresh = twins(cs)
    resumed = geomopt.GeomOptimizer(named(fresh), "adamw")
    resumed.load_state_dict(opt.state_dict())
    for k in range(2, 4):
        set_grads([cs, fresh], k)
        opt.step()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(cs, fresh))


# ------------------------------------------------------------ the functional API

@pytest.mark.parametrize("geometry", [{"kind": "euclidean"},
                                      {"kind": "anisotropic", "reference": {"kind": "indicator"}},
                                      {"kind": "isotropic", "reference": {"kind": "quadratic"}}],
                         ids=lambda g: g["kind"])
def test_functional_steps_a_complex_tensor_as_its_real_view(geometry):
    from geomopt.functional import backward_step, forward_step
    d = torch.randn(6, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    u = forward_step(d, geometry)
    assert u.dtype == torch.complex64
    assert torch.equal(torch.view_as_real(u), forward_step(torch.view_as_real(d), geometry))
    x = backward_step(d, 0.1, geometry, None)
    assert torch.equal(torch.view_as_real(x), backward_step(torch.view_as_real(d), 0.1, geometry, None))


@pytest.mark.parametrize("approx", [None, {"kind": "newton_schulz"}])
def test_functional_refuses_a_complex_matrix_under_a_spectral_geometry(approx):
    """A map of the real view is not the complex polar factor U Vᴴ (cosine about 0.5 with it), and
    a cast to real drops the imaginary part: refused, as GeomOptimizer refuses the rule."""
    from geomopt.functional import backward_step, forward_step
    geometry = {"kind": "spectral", "reference": {"kind": "indicator"}, **({"approx": approx} if approx else {})}
    d = torch.randn(6, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="complex.*spectral geometry.*view_as_real"):
        forward_step(d, geometry)
    with pytest.raises(ValueError, match="complex.*spectral geometry.*view_as_real"):
        backward_step(d, 0.1, geometry, None)
    with pytest.raises(ValueError, match="with a constraint"):
        backward_step(d, 0.1, {"kind": "euclidean"}, {"kind": "frobenius_ball", "radius": 1.0})


def test_nesterov_sgd_steps_complex_parameters_as_torch_sgd_does():
    """Heavy ball with Nesterov (elementwise, so the flat path, and complex parameters step):
    torch.optim.SGD(nesterov=True)'s parameters, bit for bit on real tensors and on the real views
    of complex ones."""
    spec = {"geomopt": 1, "name": "sgd-nesterov", "defaults": {"lr": 0.05, "weight_decay": 0.0},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                       "direction": {"kind": "heavy_ball", "momentum": 0.9, "nesterov": True}}]}
    g = torch.Generator().manual_seed(0)
    c = torch.randn(5, 3, dtype=torch.complex64, generator=g)
    r = torch.randn(7, generator=g)
    ours = [torch.nn.Parameter(c.clone()), torch.nn.Parameter(r.clone())]
    real_view = [torch.nn.Parameter(torch.view_as_real(c).clone()), torch.nn.Parameter(r.clone())]
    opt = geomopt.GeomOptimizer([("c", ours[0]), ("r", ours[1])], spec)
    ref = torch.optim.SGD(real_view, lr=0.05, momentum=0.9, nesterov=True, foreach=False)
    assert "flat" in opt.describe()
    for _ in range(4):
        gc, gr = torch.randn(5, 3, 2, generator=g), torch.randn(7, generator=g)
        ours[0].grad, ours[1].grad = torch.view_as_complex(gc.clone()), gr.clone()
        real_view[0].grad, real_view[1].grad = gc.clone(), gr.clone()
        opt.step()
        ref.step()
    assert torch.equal(torch.view_as_real(ours[0].detach()), real_view[0].detach())
    assert torch.equal(ours[1], real_view[1])
