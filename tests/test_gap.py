"""Stationarity gap ρ·[φ₁*(G) + φ₁(W) − ⟨G, W⟩] and the dual norm.

The zero test is a small constrained problem min ⟨C, X⟩ s.t. X ∈ 𝒞 with its minimizer X* in
closed form: from Y = X* − t·∇φ₁*(C) the backward step must return X* (a fixed point), and the gap
with W = (X⁺ − Y)/t and G = C must vanish; from a non-stationary X ∈ 𝒞 it must be positive.
∇φ₁* is computed here from the reference's (h*)' (not from the forward module).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from geomopt.geometry.backward import backward
from geomopt.geometry.gap import dual_norm, stationarity_gap
from geomopt.geometry.reference import make_reference

LOG = {"kind": "log_barrier", "eps": 1e-2}
POW4 = {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}
QUAD = {"kind": "quadratic"}


def _geometry(kind, ref, radius=1.0):
    return {"kind": kind, "radius": radius, **({"reference": ref} if kind != "euclidean" else {})}


def grad_conj(kind: str, ref: dict, d: torch.Tensor) -> torch.Tensor:
    """∇φ₁*(D) for each lifting of h."""
    if kind == "euclidean":
        return d
    h = make_reference(ref)
    if kind == "anisotropic":
        return h.dual_grad(d)
    if kind == "isotropic":
        return h.iso_factor(d.norm()) * d
    if kind == "spectral":
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        return (u * h.dual_grad(s)) @ vh
    if kind == "rowwise":
        return h.iso_factor(d.norm(dim=1, keepdim=True)) * d
    raise KeyError(kind)


def minimizer(ckind: str, c: torch.Tensor, r: float) -> torch.Tensor:
    """argmin ⟨C, X⟩ over the set, in closed form."""
    if ckind in ("l2_ball", "frobenius_ball", "frobenius_sphere"):
        return -r * c / c.norm()
    if ckind == "linf_ball":
        return -r * torch.sign(c)
    u, _, vh = torch.linalg.svd(c, full_matrices=False)
    if ckind in ("spectral_ball", "stiefel"):
        return -r * u @ vh
    raise KeyError(ckind)


ZERO_CASES = [
    # (geometry kind, reference, constraint kind)
    ("anisotropic", LOG, "l2_ball"),
    ("anisotropic", POW4, "l2_ball"),
    ("anisotropic", QUAD, "l2_ball"),
    ("anisotropic", LOG, "frobenius_sphere"),
    ("anisotropic", LOG, "linf_ball"),
    ("isotropic", LOG, "l2_ball"),
    ("isotropic", POW4, "frobenius_sphere"),
    ("euclidean", QUAD, "l2_ball"),
    ("spectral", LOG, "frobenius_ball"),
    ("spectral", POW4, "frobenius_ball"),
    ("spectral", LOG, "spectral_ball"),
    ("spectral", QUAD, "stiefel"),
    ("rowwise", LOG, "frobenius_ball"),
]


@pytest.mark.parametrize("gkind,ref,ckind", ZERO_CASES, ids=[f"{g}-{r['kind']}-{c}" for g, r, c in ZERO_CASES])
def test_gap_vanishes_at_stationary_point_and_not_elsewhere(gkind, ref, ckind):
    g = torch.Generator().manual_seed(0)
    cmat = torch.randn(4, 3, dtype=torch.float64, generator=g)
    r, rho, gamma = 1.5, 2.0, 0.1
    t = gamma * rho
    geo, con = _geometry(gkind, ref, rho), {"kind": ckind, "radius": r}
    scale = dual_norm(cmat, geo) * rho + 1

    # stationary: X* is a fixed point and the gap vanishes
    x_star = minimizer(ckind, cmat, r)
    y = x_star - t * grad_conj(gkind, ref, cmat)
    x_plus, fb = backward(y, gamma, geo, con)
    assert fb is None or not bool(fb)
    torch.testing.assert_close(x_plus, x_star, rtol=1e-8, atol=1e-9)
    gap = stationarity_gap(cmat, (x_plus - y) / t, geo)
    assert 0 <= float(gap) <= 1e-9 * float(scale)

    # non-stationary: one step from another point of the set leaves a positive gap
    v = torch.randn(4, 3, dtype=torch.float64, generator=g)
    x = {"stiefel": lambda: r * torch.linalg.qr(v).Q, "linf_ball": lambda: torch.zeros_like(v),
         "spectral_ball": lambda: torch.zeros_like(v)}.get(ckind, lambda: r * v / v.norm())()
    y = x - t * grad_conj(gkind, ref, cmat)
    x_plus, _ = backward(y, gamma, geo, con)
    gap = stationarity_gap(cmat, (x_plus - y) / t, geo)
    assert float(gap) > 1e-3 * float(scale)


def _dual_ball_direction(gkind: str, shape, rng, size):
    """W strictly inside dom φ₁."""
    v = rng.standard_normal(shape)
    if gkind == "anisotropic":
        return rng.uniform(-size, size, shape)
    if gkind in ("isotropic", "euclidean"):
        return size * v / np.linalg.norm(v)
    if gkind == "spectral":
        u, s, vt = np.linalg.svd(v, full_matrices=False)
        return (u * rng.uniform(0, size, s.shape)[..., None, :]) @ vt
    axis = -1 if gkind == "rowwise" else -2
    return size * v / np.linalg.norm(v, axis=axis, keepdims=True)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["anisotropic", "isotropic", "euclidean", "spectral", "rowwise", "columnwise"]),
       st.sampled_from([LOG, POW4, QUAD, {"kind": "log_barrier", "eps": 1e-8}]),
       st.integers(0, 2**31 - 1), st.floats(0.0, 0.999999), st.floats(1e-3, 1e3))
def test_gap_nonnegative(gkind, ref, seed, size, gscale):
    rng = np.random.default_rng(seed)
    w = torch.tensor(_dual_ball_direction(gkind, (2, 4, 3), rng, size))
    gr = torch.tensor(rng.standard_normal((2, 4, 3)) * gscale)
    for dtype in (torch.float64, torch.float32):
        gap = stationarity_gap(gr.to(dtype), w.to(dtype), _geometry(gkind, ref, 0.7), batch_dims=1)
        assert gap.shape == (2,) and bool((gap >= 0).all()) and bool(torch.isfinite(gap).all())


def test_gap_zero_iff_g_is_grad_phi_of_w():
    """Per entry: G = ∇φ₁(W) ⇔ gap = 0 (anisotropic log barrier, spectral, isotropic)."""
    w = torch.tensor([[0.3, -0.9], [0.0, 0.5]], dtype=torch.float64)
    h = make_reference(LOG)
    g = h.dh(w)
    assert float(stationarity_gap(g, w, _geometry("anisotropic", LOG))) <= 1e-14
    assert float(stationarity_gap(g + 0.1, w, _geometry("anisotropic", LOG))) > 1e-6
    w = 0.8 * w / w.norm()  # inside the spectral and Frobenius unit balls
    u, s, vh = torch.linalg.svd(w)
    gs = (u * h.dh(s)) @ vh
    assert float(stationarity_gap(gs, w, _geometry("spectral", LOG))) <= 1e-13
    n = w.norm()
    gi = h.dh(n) * w / n
    assert float(stationarity_gap(gi, w, _geometry("isotropic", LOG))) <= 1e-14


def test_euclidean_gap_is_half_squared_distance():
    g = torch.randn(3, 5, dtype=torch.float64)
    w = torch.randn(3, 5, dtype=torch.float64)
    gap = stationarity_gap(g, w, _geometry("euclidean", QUAD, 3.0))
    torch.testing.assert_close(gap, 3.0 * 0.5 * (w - g).square().sum())


def test_gap_not_available():
    g = w = torch.zeros(3, 3)
    assert stationarity_gap(g, w, _geometry("spectral", {"kind": "indicator"})) is None
    assert stationarity_gap(g, w, {**_geometry("spectral", LOG), "approx": {"kind": "newton_schulz", "steps": 5}}) is None
    assert stationarity_gap(g, w, {**_geometry("spectral", LOG), "approx": {"kind": "polar_express", "steps": 5}}) is None
    assert stationarity_gap(g, w, {"kind": "adam", "radius": 1.0}) is None
    assert stationarity_gap(g, w, {**_geometry("spectral", LOG), "approx": {"kind": "svd"}}) is not None


def test_gap_outside_domain_is_infinite():
    w = torch.tensor([1.5, 0.0], dtype=torch.float64)
    assert math.isinf(float(stationarity_gap(torch.zeros(2, dtype=torch.float64), w, _geometry("anisotropic", LOG))))


def test_dual_norms():
    g = torch.randn(2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    nuc = torch.linalg.matrix_norm(g, ord="nuc")
    torch.testing.assert_close(dual_norm(g, _geometry("spectral", LOG), batch_dims=1), nuc)
    split = torch.linalg.matrix_norm(g.reshape(2, 2, 2, 6), ord="nuc").sum(-1)
    blocks = {"kind": "matrix", "blocks": 2}
    torch.testing.assert_close(dual_norm(g, {**_geometry("spectral", LOG), "view": blocks}, batch_dims=1), split)
    experts = {"kind": "matrix", "batch": 1}
    torch.testing.assert_close(dual_norm(g.reshape(1, 2, 4, 6), {**_geometry("spectral", LOG), "view": experts}, batch_dims=1),
                               nuc.sum().reshape(1))
    torch.testing.assert_close(dual_norm(g, _geometry("anisotropic", LOG), 1), g.abs().sum((1, 2)))
    torch.testing.assert_close(dual_norm(g, _geometry("isotropic", LOG), 1), g.norm(dim=(1, 2)))
    torch.testing.assert_close(dual_norm(g, _geometry("rowwise", LOG), 1), g.norm(dim=2).sum(1))
    torch.testing.assert_close(dual_norm(g, _geometry("columnwise", LOG), 1), g.norm(dim=1).sum(1))
