"""Scalar reference functions h against independent references (scipy quadrature, autograd,
brute-force Fenchel conjugation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, optimize, special

import typed_fragments as typed
from geomopt.geometry.reference import REFERENCES, make_reference

F64 = torch.float64

# (spec fragment) rows: every reference kind, the power barrier at several κ and ε.
BARRIERS = [
    {"kind": "log_barrier", "eps": 1e-3},
    {"kind": "log_barrier", "eps": 0.3},
    {"kind": "power_barrier", "kappa": 1.0, "eps": 1e-2},
    {"kind": "power_barrier", "kappa": 1.5, "eps": 1e-2},
    {"kind": "power_barrier", "kappa": 2.0, "eps": 1e-3},
    {"kind": "power_barrier", "kappa": 3.0, "eps": 0.5},
    {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
    {"kind": "power_barrier", "kappa": 4.0, "eps": 1.05e-3},
    {"kind": "power_barrier", "kappa": 8.0, "eps": 2e-2},
]
ALL = BARRIERS + [{"kind": "indicator"}, {"kind": "quadratic"}]


def _id(cfg):
    return "-".join(f"{v}" for v in cfg.values())


def t64(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- independent scalar references


def h_quad(x: float, kappa: float, eps: float) -> float:
    """ε∫₀^{|x|} s(1−s^κ)^{−1/κ} ds by scipy quad; near the boundary h(1) − ∫ with scipy's
    algebraic weight (1−s)^{−1/κ} carrying the singularity (w = 1 − s)."""
    a = abs(x)
    if a > 1:
        return math.inf
    if a <= 0.9:
        f = lambda s: s * (1 - s**kappa) ** (-1 / kappa)  # noqa: E731
        return eps * integrate.quad(f, 0, a, epsabs=0, epsrel=2e-14, limit=200)[0]
    if kappa == 1.0:  # no cancellation in the closed form this far from 0
        return math.inf if a == 1 else eps * (-math.log1p(-a) - a)
    h1 = special.beta(2 / kappa, 1 - 1 / kappa) / kappa  # ∫₀¹ via s^κ = t

    def g(w):  # integrand without the w^{−1/κ} factor, w = 1 − s
        return (1 - w) * (-math.expm1(kappa * math.log1p(-w)) / w) ** (-1 / kappa) if w > 0 else kappa ** (-1 / kappa)

    tail = integrate.quad(g, 0, 1 - a, weight="alg", wvar=(-1 / kappa, 0), epsabs=0, epsrel=2e-14, limit=200)[0]
    return eps * (h1 - tail)


def conj_quad(y: float, kappa: float, eps: float) -> float:
    """∫₀^{|y|} s(ε^κ+s^κ)^{−1/κ} ds by scipy quad, with breakpoints every decade above ε."""
    a = abs(y)
    if a == 0:
        return 0.0
    f = lambda s: s * (eps**kappa + s**kappa) ** (-1 / kappa)  # noqa: E731
    pts = [eps * 10.0**k for k in range(0, 12) if eps * 10.0**k < a]
    return integrate.quad(f, 0, a, points=pts or None, epsabs=0, epsrel=1e-13, limit=500)[0]


# ---------------------------------------------------------------- power barrier h and h*


@pytest.mark.parametrize("kappa", [1.0, 1.5, 2.0, 3.0, 4.0, 8.0])
def test_power_barrier_h_matches_quadrature(kappa):
    eps = 1e-3
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": kappa, "eps": eps}))
    xs = [0.0, 1e-9, 1e-3, -0.2, 0.5, -0.75, 0.9, 0.99, 0.999999, -(1 - 1e-12), 1 - 2**-52]
    if kappa > 1:
        xs.append(1.0)  # h(±1) is finite for κ > 1
    got = ref.h(t64(xs)).numpy()
    want = np.array([h_quad(x, kappa, eps) for x in xs])
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=0)


@pytest.mark.parametrize("kappa", [1.0, 1.5, 2.0, 3.0, 4.0, 8.0])
def test_power_barrier_conj_matches_quadrature(kappa):
    eps = 1e-3
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": kappa, "eps": eps}))
    ys = [0.0, 1e-12, 1e-6, -5e-4, 1e-3, 2e-3, -0.05, 1.0, 37.0, -1e3 * eps, 1e5 * eps, 1e8 * eps]
    got = ref.conj(t64(ys)).numpy()
    want = np.array([conj_quad(y, kappa, eps) for y in ys])
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=0)


def test_power_barrier_closed_forms():
    """κ = 2: h = ε(1−√(1−x²)), h* = √(ε²+y²)−ε; κ = 1 is the log barrier (geomopt.geometry.reference)."""
    x = torch.linspace(-0.999, 0.999, 101, dtype=F64)
    y = torch.logspace(-8, 4, 101, dtype=F64)
    k2 = make_reference(typed.reference({"kind": "power_barrier", "kappa": 2, "eps": 0.1}))
    torch.testing.assert_close(k2.h(x), 0.1 * (1 - torch.sqrt(1 - x * x)), rtol=1e-12, atol=1e-17)
    torch.testing.assert_close(k2.conj(y[50:]), torch.sqrt(0.01 + y[50:] ** 2) - 0.1, rtol=1e-12, atol=0)
    k1 = make_reference(typed.reference({"kind": "power_barrier", "kappa": 1, "eps": 0.1}))
    lb = make_reference(typed.reference({"kind": "log_barrier", "eps": 0.1}))
    for fn in ("h", "dh", "dual_grad", "conj", "iso_factor"):
        arg = x if fn in ("h", "dh") else y
        torch.testing.assert_close(getattr(k1, fn)(arg), getattr(lb, fn)(arg), rtol=1e-13, atol=0)


def test_hypergeometric_form_away_from_boundary():
    """h = ε(x²/2)·₂F₁(2/κ,1/κ;1+2/κ;|x|^κ) (paper Appendix F) where scipy's ₂F₁ is reliable."""
    for kappa in (1.5, 3.0, 4.0):
        ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": kappa, "eps": 0.2}))
        xs = np.array([0.01, 0.3, 0.6, 0.8])
        want = 0.2 * xs**2 / 2 * special.hyp2f1(2 / kappa, 1 / kappa, 1 + 2 / kappa, xs**kappa)
        np.testing.assert_allclose(ref.h(t64(xs)).numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("cfg", BARRIERS, ids=_id)
def test_outside_domain_is_infinite(cfg):
    ref = make_reference(typed.reference(cfg))
    out = ref.h(t64([1.5, -1.0000001, 7.0]))
    assert torch.isinf(out).all() and (out > 0).all()


# ---------------------------------------------------------------- derivatives and conjugacy


@pytest.mark.parametrize("cfg", ALL, ids=_id)
def test_dual_grad_is_derivative_of_conj(cfg):
    ref = make_reference(typed.reference(cfg))
    eps = getattr(ref, "eps", 1.0) or 1.0
    y = torch.tensor([-300.0, -3.0, -0.7, -0.2, 0.1, 0.5, 1.3, 40.0], dtype=F64).mul(eps).requires_grad_(True)
    (g,) = torch.autograd.grad(ref.conj(y).sum(), y)
    torch.testing.assert_close(g, ref.dual_grad(y.detach()), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cfg", BARRIERS + [{"kind": "quadratic"}], ids=_id)
def test_dh_is_derivative_of_h(cfg):
    ref = make_reference(typed.reference(cfg))
    x = torch.tensor([-0.999, -0.9, -0.5, -1e-3, 0.0, 0.2, 0.7, 0.95, 0.9999], dtype=F64).requires_grad_(True)
    (g,) = torch.autograd.grad(ref.h(x).sum(), x)
    torch.testing.assert_close(g, ref.dh(x.detach()), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cfg", BARRIERS + [{"kind": "quadratic"}], ids=_id)
def test_dual_grad_inverts_dh(cfg):
    """(h*)' = (h')^{-1} (paper Lemma A.1). h'(x) amplifies the rounding of x by 1/(1 − |x|^κ), so y
    stays where 1 − |x|^κ ≳ 1e-6: |y| ≤ ε·10^{6/κ}."""
    ref = make_reference(typed.reference(cfg))
    eps = ref.eps
    y = torch.linspace(-1, 1, 401, dtype=F64) * eps * 10 ** (6 / (ref.kappa or 6))
    torch.testing.assert_close(ref.dh(ref.dual_grad(y)), y, rtol=1e-9, atol=1e-14 * eps)
    x = torch.linspace(-0.99, 0.99, 199, dtype=F64)
    torch.testing.assert_close(ref.dual_grad(ref.dh(x)), x, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cfg", ALL, ids=_id)
def test_iso_factor_times_s_is_dual_grad(cfg):
    ref = make_reference(typed.reference(cfg))
    s = torch.tensor([0.0, 1e-12, 1e-4, 0.3, 2.0, 1e6], dtype=F64)
    torch.testing.assert_close(ref.iso_factor(s) * s, ref.dual_grad(s), rtol=1e-14, atol=0)
    assert torch.isfinite(ref.iso_factor(s)).all()


@pytest.mark.parametrize("cfg", BARRIERS, ids=_id)
def test_fenchel_conjugacy_brute_force(cfg):
    """h*(y) = sup_{|x|≤1} xy − h(x), the sup found by a bounded scalar search (no use of h')."""
    ref = make_reference(typed.reference(cfg))
    # y = h'(x₀) for x₀ spread over the domain, so the sup is attained in the interior.
    for y in ref.dh(t64([-0.99, -0.5, 0.02, 0.9, 0.999])).tolist():
        def neg(x):
            return -(x * y - ref.h(t64([x])).item())

        lo, hi = (0.0, 1.0) if y > 0 else (-1.0, 0.0)
        res = optimize.minimize_scalar(neg, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13})
        assert ref.conj(t64([y])).item() == pytest.approx(-res.fun, rel=1e-8, abs=1e-300)


@settings(max_examples=40, deadline=None)
@given(
    kappa=st.sampled_from([1.5, 2.0, 3.0, 4.0, 6.0]),
    log_eps=st.floats(-6, 0),
    log_y=st.floats(-10, 8),
)
def test_fenchel_young_equality_at_the_dual_point(kappa, log_eps, log_y):
    """h(x) + h*(y) = xy at x = (h*)'(y), wherever 1 − x is representable."""
    eps, y = 10.0**log_eps, 10.0 ** (log_y + log_eps)
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": kappa, "eps": eps}))
    x = ref.dual_grad(t64([y]))
    if 1 - x.item() < 1e-10:
        x = t64([1 - 1e-10])
        y = ref.dh(x).item()
    lhs = ref.h(x) + ref.conj(t64([y]))
    assert lhs.item() == pytest.approx(x.item() * y, rel=1e-9)


def test_registry_holds_every_spec_kind():
    assert set(REFERENCES) == {"log_barrier", "power_barrier", "indicator", "quadratic"}
    assert make_reference(typed.reference({"kind": "indicator"})).dual_grad(t64([0.0, -2.0])).tolist() == [0.0, -1.0]


def test_large_tensors_are_integrated_in_chunks_with_the_same_values():
    """h and h* of a tensor larger than one quadrature batch equal the elementwise values."""
    ref = make_reference(typed.reference({"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3}))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 130, generator=g, dtype=F64) * 2 - 1  # 39000 > one chunk
    y = torch.randn(300, 130, generator=g, dtype=F64)
    idx = torch.tensor([0, 7, 33000, 38999])
    torch.testing.assert_close(ref.h(x).flatten()[idx], ref.h(x.flatten()[idx]), rtol=0, atol=0)
    torch.testing.assert_close(ref.conj(y).flatten()[idx], ref.conj(y.flatten()[idx]), rtol=0, atol=0)
    assert ref.h(x.float()).dtype == torch.float32
