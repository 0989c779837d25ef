"""A learned metric's factors in bfloat16 (``state: {factors: bfloat16}``): Shampoo's, SOAP's and
PSGD's L and R are stored as bf16 (stochastically rounded float32 factors, within one bf16 spacing
of the float64 statistic), everything else keeps its own precision (roots and bases float32, the
moments the rule's ``dtype``), a checkpoint resumes bit for bit, a non-finite gradient leaves
them as they were, the bytes drop by half the factors', and the spelling round-trips through the
DSL."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import geomopt
from geomopt.compile.compiler import as_spec
from geomopt.optim.units.state_keys import FACTORS, STATE_KINDS

METHODS = ("shampoo", "soap", "psgd")


def _spec(method: str, factors: str = "bfloat16", dtype: str = "float32", **geometry) -> dict:
    return {"geomopt": 1, "name": "k", "defaults": {"on_nonfinite": "skip"},
            "rules": [{"name": "all", "match": "**", "state": {"dtype": dtype, "factors": factors},
                       "geometry": {"kind": "kronecker", "method": method, "every": 1, **geometry}}]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))


def _grads(model: nn.Module, steps: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(steps)]


def _run(opt, model, grads) -> None:
    for gs in grads:
        for p, g in zip(model.parameters(), gs):
            p.grad = g.clone()
        opt.step()


def test_the_declared_factors_are_the_kronecker_methods_l_and_r():
    assert set(FACTORS) == {f"{m}_{side}" for m in METHODS for side in ("left", "right")}
    assert all(k in STATE_KINDS[m] for m in METHODS for k in (f"{m}_left", f"{m}_right"))


@pytest.mark.parametrize("method", METHODS)
def test_factors_are_bf16_and_the_rest_keeps_its_precision(method):
    model = _model()
    opt = geomopt.GeomOptimizer(model, _spec(method, dtype="bfloat16"), lr=0.01)
    _run(opt, model, _grads(model, 3))
    for p in model.parameters():
        state = opt.state[p]
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            if key in FACTORS:
                assert value.dtype == torch.bfloat16, key
            elif key.endswith(("_basis", "_root", "_graft")):
                assert value.dtype == torch.float32, key
            else:  # the moments: the rule's dtype
                assert value.dtype == torch.bfloat16, key


@pytest.mark.parametrize("method", ["shampoo", "soap"])
def test_a_first_factor_is_the_statistic_rounded_to_a_neighbouring_bf16(method):
    """From zero, one step's factors are w·G·Gᵀ and w·Gᵀ·G (w = 1 − β): each stored entry is one of
    the two bf16 values around the float64 statistic (stochastic rounding), so within one spacing."""
    beta = 0.95
    model = nn.Linear(12, 8, bias=False)
    opt = geomopt.GeomOptimizer(model, _spec(method, beta=beta), lr=0.01)
    g = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    model.weight.grad = g.clone()
    opt.step()
    g64 = g.double()
    for key, ref in ((f"{method}_left", g64 @ g64.T), (f"{method}_right", g64.T @ g64)):
        ref = (1 - beta) * ref
        got = opt.state[model.weight][key]
        assert got.dtype == torch.bfloat16
        spacing = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)  # 2⁻⁷ relative: one spacing
        assert ((got.double() - ref).abs() <= spacing).all(), key
        assert not torch.equal(got.double(), ref), key  # rounded: some bits were lost


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_with_bf16_factors_resumes_bit_for_bit(method):
    model = _model()
    grads = _grads(model, 6)
    straight = geomopt.GeomOptimizer(model, _spec(method), lr=0.01)
    _run(straight, model, grads)
    want = [p.detach().clone() for p in model.parameters()]

    model = _model()
    opt = geomopt.GeomOptimizer(model, _spec(method), lr=0.01)
    _run(opt, model, grads[:3])
    saved = opt.state_dict()
    opt = geomopt.GeomOptimizer(model, _spec(method), lr=0.01)
    opt.load_state_dict(saved)
    _run(opt, model, grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(want, model.parameters()))


@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_gradient_leaves_bf16_factors_as_they_were(method):
    model = _model()
    opt = geomopt.GeomOptimizer(model, _spec(method), lr=0.01)
    grads = _grads(model, 3)
    _run(opt, model, grads[:2])
    params = list(model.parameters())
    before = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    x = [p.detach().clone() for p in params]
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    params[0].grad[0, 0] = float("nan")
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(x, params))
    for p, b in zip(params, before):
        assert all(torch.equal(v, opt.state[p][k]) for k, v in b.items())


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("method", METHODS)
def test_bf16_factors_hold_half_the_factors_bytes(method):
    sizes = {}
    for factors in ("float32", "bfloat16"):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec(method, factors=factors), lr=0.01)
        _run(opt, model, _grads(model, 2))
        factor_numel = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k in FACTORS)
        sizes[factors] = _state_bytes(opt), factor_numel
    (f32, n), (bf16, _) = sizes["float32"], sizes["bfloat16"]
    assert n > 0 and f32 - bf16 == 2 * n


def test_a_checkpoint_loads_under_another_factor_precision():
    """Each entry records its precision: float32 factors saved, a bf16-factor optimizer (a spec change,
    allowed) carries them over and stores its own precision after its next step (and the other way
    round)."""
    for saved_as, loaded_as, want in (("float32", "bfloat16", torch.bfloat16), ("bfloat16", "float32", torch.float32)):
        model = _model()
        opt = geomopt.GeomOptimizer(model, _spec("shampoo", factors=saved_as), lr=0.01)
        grads = _grads(model, 3)
        _run(opt, model, grads[:2])
        saved = opt.state_dict()
        opt = geomopt.GeomOptimizer(model, _spec("shampoo", factors=loaded_as), lr=0.01)
        opt.load_state_dict(saved, allow_spec_change=True)
        _run(opt, model, grads[2:])
        w = next(model.parameters())
        assert opt.state[w]["shampoo_left"].dtype == want
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_factors_spell_as_a_state_argument_in_the_dsl():
    spec = as_spec(_spec("soap", dtype="int8-ec"))
    text = geomopt.dump_spec(spec, "dsl")
    assert "state=int8-ec(factors=bfloat16)" in text
    again = geomopt.parse_spec(text, "dsl")
    assert again.rules[0].state.factors == "bfloat16" and again.rules[0].state.dtype == "int8-ec"
    assert "factors: bfloat16" in geomopt.dump_spec(spec)


def test_an_unknown_factor_precision_is_refused_where_it_is_written():
    with pytest.raises(geomopt.SpecError, match="factors"):
        as_spec(_spec("shampoo", factors="int8"))
