"""Stationarity gap ρ·[φ₁*(Ĝ) + φ₁(W) − ⟨Ĝ, W⟩] and the dual norm.

The zero test is a small constrained problem min ⟨C, X⟩ s.t. X ∈ 𝒞 with its minimizer X* in
closed form: from Y = X* − t·∇φ₁*(C) the backward step must return X* (a fixed point), and the gap
with W = (X⁺ − Y)/t and G = C must vanish; from a non-stationary X ∈ 𝒞 it must be positive.
∇φ₁* is computed here from the reference's (h*)' (not from the forward module).

Newton–Schulz / Polar Express rules: the same zero test with the realized map on the
pre-normalized Ĉ; the optimizer run to a known stationary point, its gap checked against an
independent float64 evaluation (scipy quadrature and conjugation); ``diagnostics()`` on the
shipped specs (a value for every constrained rule, a reason naming the rule elsewhere).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import integrate, optimize
from torch import nn

import typed_fragments as typed
import geomopt
from typed_fragments import backward, dual_norm, gap_reference, gap_unavailable, stationarity_gap
from geomopt.geometry.reference import make_reference
from geomopt.geometry.polynomial import compose_polynomials
from geomopt.support import approx_coefficients, realized_reference
from geomopt.compile.compiler import as_spec
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.spec.geometries import NoPrenorm
from optim_helpers import SPECS, gpt_batch, loss_of, mlp_batch, tiny_gpt, tiny_mlp

LOG = {"kind": "log_barrier", "eps": 1e-2}
POW4 = {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-2}
QUAD = {"kind": "quadratic"}


def _geometry(kind, ref, radius=1.0):
    return {"kind": kind, "radius": radius, **({"reference": ref} if kind != "euclidean" else {})}


def grad_conj(kind: str, ref: dict, d: torch.Tensor) -> torch.Tensor:
    """∇φ₁*(D) for each lifting of h."""
    if kind == "euclidean":
        return d
    h = make_reference(typed.reference(ref))
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
    h = make_reference(typed.reference(LOG))
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


def test_spectral_quadratic_gap_is_half_squared_distance_for_unaligned_matrices():
    """h = ½σ² lifted to singular values: φ₁(W) + φ₁*(G) − ⟨G, W⟩ = ½‖W‖² + ½‖G‖² − ⟨G, W⟩ = ½‖W − G‖²_F,
    whose von Neumann slack Σσ(G)σ(W) − ⟨G, W⟩ is positive for matrices with different singular vectors."""
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(2, 4, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(2, 4, 3, dtype=torch.float64, generator=gen)
    gap = stationarity_gap(g, w, _geometry("spectral", QUAD, 3.0), batch_dims=1)
    torch.testing.assert_close(gap, 3.0 * 0.5 * (w - g).square().sum((1, 2)), rtol=1e-12, atol=1e-12)


def test_gap_over_a_view_gives_each_block_its_radius():
    """Blocks of rows with radius factors f: block i is its own matrix with radius ρ·fᵢ, paired with
    the step's W scaled to it, W_i/fᵢ: Σ ρfᵢ·½‖W_i/fᵢ − G_i‖²_F for the quadratic reference."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(5, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(5, 3, dtype=torch.float64, generator=gen)
    view = {"batch": 0, "trailing": "cols", "blocks": [2, 3], "factors": [1.0, 2.5]}
    gap = stationarity_gap(g, w, {**_geometry("spectral", QUAD, 0.7), "view": view})
    want = sum(0.7 * f * 0.5 * float((w[rows] / f - g[rows]).square().sum())
               for rows, f in ((slice(0, 2), 1.0), (slice(2, 5), 2.5)))
    assert float(gap) == pytest.approx(want, rel=1e-12)


def test_gap_over_experts_is_the_sum_of_each_experts_gap():
    """An experts view (batch 1): each (m, n) matrix is its own, so the gap is the sum of the plain
    gaps of the matrices (not that of the merged (E, m·n) matrix); a geometry without a radius has
    radius 1."""
    gen = torch.Generator().manual_seed(6)
    g = torch.randn(3, 4, 2, dtype=torch.float64, generator=gen)
    w = 0.3 * torch.randn(3, 4, 2, dtype=torch.float64, generator=gen)
    geometry = {"kind": "spectral", "reference": LOG}
    gap = stationarity_gap(g, w, {**geometry, "view": {"batch": 1, "trailing": "cols", "blocks": None,
                                                       "factors": None}})
    want = sum(float(stationarity_gap(g[e], w[e], _geometry("spectral", LOG, 1.0))) for e in range(3))
    assert float(gap) == pytest.approx(want, rel=1e-12)
    assert float(stationarity_gap(g[0], w[0], geometry)) == float(stationarity_gap(g[0], w[0],
                                                                                  _geometry("spectral", LOG, 1.0)))


def test_gap_not_available():
    g = w = torch.zeros(3, 3)
    assert stationarity_gap(g, w, _geometry("spectral", {"kind": "indicator"})) is None
    assert stationarity_gap(g, w, {"kind": "adam", "radius": 1.0}) is None
    assert stationarity_gap(g, w, {**_geometry("spectral", LOG), "approx": {"kind": "svd"}}) is not None
    for approx in ("newton_schulz", "polar_express"):  # measured, against a barrier (never the indicator)
        geo = {**_geometry("spectral", LOG), "approx": {"kind": approx, "steps": 5}}
        for con in (None, {"kind": "frobenius_ball", "radius": 1.0}, {"kind": "spectral_ball", "radius": 1.0}):
            assert float(stationarity_gap(g, w, geo, constraint=con)) == 0.0
            assert gap_unavailable(geo, con) is None
    # why not: named
    assert "adam" in gap_unavailable({"kind": "adam", "radius": 1.0})
    why = gap_unavailable(_geometry("spectral", {"kind": "indicator"}), {"kind": "stiefel", "radius": 1.0})
    assert "indicator" in why and "barrier" in why


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


# ---------------------------------------------------------------- Newton–Schulz / Polar Express rules
#
# The forward step of a polynomial iteration sees D̂ = D/(‖D‖_F + ε) and realizes (approximately)
# the κ = 4 power barrier with ε = 1/∏aᵢ; the gap pairs W with Ĝ and measures it against the
# backward step's reference (declared), or the realized one where the backward step does not
# depend on h (spectral set projections).

NS = {"kind": "newton_schulz", "steps": 5}
PE = {"kind": "polar_express", "steps": 5}


def _polynomial_geometry(approx, ref=None, radius=1.0, **extra):
    ref = ref or realized_reference(approx)
    return {"kind": "spectral", "radius": radius, "reference": ref, "approx": approx, **extra}


def _without_prenormalize(geo: dict, shape=None) -> ResolvedGeometry:
    """``geo`` without pre-normalization: a geometry the spec refuses for a polynomial approx (the
    iteration diverges), built past validation to measure what the gap's pre-normalization does."""
    g = typed.geometry(geo, shape)
    return ResolvedGeometry(g.spec.model_copy(update={"prenormalize": NoPrenorm()}), g.view)


def test_gap_reference_choice():
    realized = realized_reference(NS)
    assert realized["kind"] == "power_barrier" and realized["eps"] == pytest.approx(1 / 3.4445**5)
    geo = _polynomial_geometry(NS, LOG)
    h_dependent, projection = {"kind": "frobenius_ball", "radius": 1.0}, {"kind": "spectral_ball", "radius": 1.0}
    assert gap_reference(geo, h_dependent) == LOG  # the backward step's own reference
    assert gap_reference(geo, projection) == realized  # every reference certifies: the forward's
    assert gap_reference(geo, None) == realized
    assert gap_reference(geo, projection, "declared") == LOG
    assert gap_reference(geo, h_dependent, "realized") == realized
    svd = {**_geometry("spectral", LOG), "approx": {"kind": "svd"}}
    assert gap_reference(svd, projection, "realized") == LOG  # exact: realizes the declared one
    assert gap_reference({"kind": "adam"}) is None
    with pytest.raises(ValueError, match="unknown gap reference"):
        gap_reference(geo, None, "exact")
    # indicator declared: no gap against it, but the realized barrier certifies a set projection
    ind = _polynomial_geometry(NS, {"kind": "indicator"})
    g = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert stationarity_gap(g, torch.zeros_like(g), ind, constraint=projection, reference="declared") is None
    assert "'auto'" in gap_unavailable(ind, projection, "declared")
    assert float(stationarity_gap(g, torch.zeros_like(g), ind, constraint=projection)) > 0
    assert stationarity_gap(g, torch.zeros_like(g), ind, constraint=h_dependent) is None
    assert "declare a barrier" in gap_unavailable(ind, h_dependent)


POLY_CASES = [(a, c) for a in (NS, PE) for c in ("frobenius_ball", "frobenius_sphere", "spectral_ball")]


@pytest.mark.parametrize("approx,ckind", POLY_CASES, ids=[f"{a['kind']}-{c}" for a, c in POLY_CASES])
def test_polynomial_rule_gap_vanishes_at_stationary_point(approx, ckind):
    """min ⟨C, X⟩ over the set, C small (σ(C) ≈ ε of the realized barrier): from
    Y = X* − t·∇φ₁*(Ĉ) (the realized map, exactly) the backward step returns X* and the gap of the
    Newton–Schulz / Polar Express geometry vanishes; pairing W with the raw C instead leaves
    D_{φ₁*}(C, Ĉ) > 0 (why the gap pre-normalizes; it is ≈ 0 only where σ(C) ≫ ε), and from
    another point of the set the gap is positive."""
    gen = torch.Generator().manual_seed(1)
    cmat = 1e-3 * torch.randn(4, 3, dtype=torch.float64, generator=gen)
    r, rho, gamma = 1.5, 2.0, 0.1
    t = gamma * rho
    geo, con = _polynomial_geometry(approx, radius=rho), {"kind": ckind, "radius": r}
    c_hat = cmat / (cmat.norm() + 1e-7)
    x_star = minimizer(ckind, cmat, r)
    y = x_star - t * grad_conj("spectral", realized_reference(approx), c_hat)
    x_plus, fb = backward(y, gamma, geo, con)
    assert fb is None or not bool(fb)
    torch.testing.assert_close(x_plus, x_star, rtol=1e-8, atol=1e-9)
    w = (x_plus - y) / t
    gap = stationarity_gap(cmat, w, geo, constraint=con)
    assert 0 <= float(gap) <= 1e-9
    raw = stationarity_gap(cmat, w, _without_prenormalize(geo), constraint=con)
    assert float(raw) > 1e-4

    v = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    x = torch.zeros_like(v) if ckind == "spectral_ball" else r * v / v.norm()
    y = x - t * grad_conj("spectral", realized_reference(approx), c_hat)
    x_plus, _ = backward(y, gamma, geo, con)
    assert float(stationarity_gap(cmat, (x_plus - y) / t, geo, constraint=con)) > 1e-2


def test_proximal_decay_pairs_the_raw_gradient():
    """g = (1/λ)⋆φ is not a cone: −Ĝ ∈ ∂g does not give −G ∈ ∂g, so W pairs with G itself."""
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    w = 0.9 * w / torch.linalg.matrix_norm(w, ord=2)[:, None, None]
    geo = _polynomial_geometry(PE)
    decay = {"kind": "proximal_decay", "lam": 0.1}
    plain = _without_prenormalize(geo)
    torch.testing.assert_close(stationarity_gap(g, w, geo, constraint=decay, batch_dims=1),
                               stationarity_gap(g, w, plain, constraint=decay, batch_dims=1))
    assert not torch.allclose(stationarity_gap(g, w, geo, batch_dims=1), stationarity_gap(g, w, plain, batch_dims=1))


def test_polynomial_gap_batched_and_view_normalize_per_matrix():
    """Ĝ is formed per matrix, as the forward step normalizes: per batch element, and per block of
    a ``view`` (each block its own matrix, with its own radius factor)."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen)
    g = g * torch.tensor([0.1, 3.0], dtype=torch.float64)[:, None, None]  # different scales: Ĝ per element
    w = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen)
    w = 0.5 * w / torch.linalg.matrix_norm(w.reshape(2, 3, 2, 4), ord=2).amax(-1)[:, None, None]
    geo = _polynomial_geometry(NS, radius=0.7)
    con = {"kind": "frobenius_ball", "radius": 1.0}
    batched = stationarity_gap(g, w, geo, constraint=con, batch_dims=1)
    for i in range(2):
        torch.testing.assert_close(batched[i], stationarity_gap(g[i], w[i], geo, constraint=con))
    unit = lambda x: x / (torch.linalg.matrix_norm(x)[:, None, None] + 1e-7)  # noqa: E731
    plain = _without_prenormalize(geo)
    torch.testing.assert_close(batched, stationarity_gap(unit(g), w, plain, constraint=con, batch_dims=1))
    view = {"view": {"kind": "matrix", "blocks": 3}}
    blocks = stationarity_gap(g, w, {**geo, **view}, constraint=con, batch_dims=1)
    per_block = sum(stationarity_gap(unit(g[:, 2 * b:2 * b + 2]), w[:, 2 * b:2 * b + 2], plain, constraint=con,
                                     batch_dims=1) for b in range(3))
    torch.testing.assert_close(blocks, per_block)
    whole = stationarity_gap(unit(g), w, _without_prenormalize({**geo, **view}, (6, 4)), constraint=con,
                             batch_dims=1)
    assert not torch.allclose(blocks, whole, rtol=1e-3)  # not the whole tensor normalized


# ---- an independent float64 evaluation of ρ·[φ₁*(Ĝ) + φ₁(W) − ⟨Ĝ, W⟩] (scipy, no geomopt code)


def _power_conj(y: float, eps: float, kappa: float = 4.0) -> float:
    """h*(y) = ∫₀^|y| (h*)'(s) ds with (h*)'(s) = s/(ε^κ + s^κ)^{1/κ}, the map the barrier realizes."""
    return integrate.quad(lambda s: s / (eps**kappa + s**kappa) ** (1 / kappa), 0.0, abs(y),
                          epsabs=0.0, epsrel=1e-13, limit=200)[0]


def _conjugate(conj, w: float) -> float:
    """h(w) = sup_y w·y − h*(y) (h = h** for closed convex h), by bounded scalar maximization in log y."""
    if w == 0.0:
        return 0.0
    res = optimize.minimize_scalar(lambda u: conj(math.exp(u)) - abs(w) * math.exp(u), bounds=(-40.0, 8.0),
                                   method="bounded", options={"xatol": 1e-12, "maxiter": 500})
    return max(0.0, -float(res.fun))


def _spectral_fy(conj, g_hat: np.ndarray, w: np.ndarray, rho: float) -> float:
    sg, sw = np.linalg.svd(g_hat, compute_uv=False), np.linalg.svd(w, compute_uv=False)
    return rho * (sum(conj(s) for s in sg) + sum(_conjugate(conj, s) for s in sw) - float((g_hat * w).sum()))


def _clip_run(approx, ref, c, *, steps=10, r=1.0, rho=1.0, lr=0.25):
    """GeomOptimizer on one matrix X (from 0) with ∇f ≡ C (f = ⟨C, X⟩) over the spectral ball of
    radius r, direction none: X moves by t·p(σ̂ᵢ) per singular direction until clipped at the
    stationary point X* = −r·UVᵀ. Returns the parameter, the optimizer and the gaps after each step."""
    x = nn.Parameter(torch.zeros_like(c))
    spec = {"geomopt": 1, "name": "clip", "rules": [{
        "name": "hidden", "match": "**", "lr": lr, "direction": {"kind": "none"},
        "geometry": {"kind": "spectral", "reference": ref, "approx": approx, "radius": rho,
                     "prenormalize": {"kind": "frobenius", "eps": 1e-7}},
        "constraint": {"kind": "spectral_ball", "radius": r}}]}
    opt = geomopt.GeomOptimizer([("x", x)], spec, track_gap=True)
    gaps = {"auto": [], "declared": []}
    for _ in range(steps):
        x.grad = c.clone()
        opt.step()
        x.grad = c.clone()
        for ref_kind in gaps:
            gaps[ref_kind].append(opt.diagnostics(gap_reference=ref_kind)["hidden"])
    return x, opt, gaps


def _clip_problem():
    """C (5×3, ‖C‖_F = 0.3) whose normalized singular values Newton–Schulz maps below 1."""
    gen = torch.Generator().manual_seed(6)
    u = torch.linalg.qr(torch.randn(5, 3, dtype=torch.float64, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=gen)).Q
    s = torch.tensor([0.875, 0.475, 0.094], dtype=torch.float64)
    s = s / s.norm()
    return 0.3 * (u * s) @ v.T, u, v, s


def test_newton_schulz_rule_gap_matches_independent_evaluation_and_drops_at_stationary_point():
    """The NS rule (spectral-clip: projection independent of h, so 'auto' measures the realized
    κ = 4 barrier): while X is inside the ball W = 0 and the gap is ρ·φ₁*(Ĉ); once X reaches the
    stationary point X* = −r·UVᵀ, W = p(Ĉ) (the polynomial) and the gap is its model error
    ρ·Σ[h*(σ̂ᵢ) + h(p(σ̂ᵢ)) − σ̂ᵢp(σ̂ᵢ)]. Both agree with an independent float64 evaluation of
    φ₁*(Ĝ) + φ₁(W) − ⟨Ĝ, W⟩ (h* by quadrature of the realized (h*)', h as its conjugate by
    maximization); 'declared' measures the declared log barrier instead."""
    approx = {**NS, "dtype": "float64"}
    realized = realized_reference(approx)
    c, u, v, s = _clip_problem()
    s_hat = s * (0.3 / (0.3 + 1e-7))  # σ(Ĉ): the forward's pre-normalization, ε = 1e-7
    p = compose_polynomials(approx_coefficients(approx), s_hat)
    assert bool((p < 0.99).all())  # the stationary point is reached by feasible steps
    rho = 1.0
    x, opt, gaps = _clip_run(approx, LOG, c, rho=rho)
    torch.testing.assert_close(x.detach(), -(u @ v.T), rtol=0, atol=1e-12)  # X* reached
    c_hat = (c / (c.norm() + 1e-7)).numpy()
    eps_r = realized["eps"]
    conj_r = functools.partial(_power_conj, eps=eps_r)
    conj_log = lambda y: abs(y) - LOG["eps"] * math.log1p(abs(y) / LOG["eps"])  # noqa: E731
    auto = [d["gap"] for d in gaps["auto"]]
    assert all(d["gap_note"] is None for d in gaps["auto"])
    # first step: no direction clipped yet, W = 0
    assert auto[0] == pytest.approx(_spectral_fy(conj_r, c_hat, np.zeros((5, 3)), rho), rel=1e-7)
    # at X*: W is the polynomial's output, the gap its model error
    w = opt.state[x]["w"].numpy()
    np.testing.assert_allclose(np.linalg.svd(w, compute_uv=False), np.sort(p.numpy())[::-1], rtol=1e-10)
    expected = _spectral_fy(conj_r, c_hat, w, rho)
    assert auto[-1] == pytest.approx(expected, rel=1e-6)
    assert auto[-1] < 0.5 * auto[0]  # dropped to the floor as X reached the stationary point
    assert all(b <= a * (1 + 1e-9) for a, b in zip(auto, auto[1:]))  # non-increasing
    declared = gaps["declared"][-1]["gap"]
    assert declared == pytest.approx(_spectral_fy(conj_log, c_hat, w, rho), rel=1e-6)
    assert abs(declared - auto[-1]) > 1e-3 * auto[-1]  # a different reference, a different number

    # the exact realized map (svd with the realized barrier) reaches the same X* with gap ~0:
    # the Newton–Schulz floor above is the polynomial's deviation from that barrier
    x2, _, gaps2 = _clip_run({"kind": "svd"}, realized, c, rho=rho)
    torch.testing.assert_close(x2.detach(), -(u @ v.T), rtol=0, atol=1e-12)
    assert gaps2["auto"][-1]["gap"] <= 1e-10 and gaps2["auto"][0]["gap"] == pytest.approx(auto[0], rel=1e-9)


def test_polynomial_overshoot_gives_infinite_gap_with_a_note():
    """Polar Express maps σ̂ = 0.475 to 1.11 > 1: once that direction is clipped W leaves dom φ₁,
    the gap is +∞, the step is counted as a fallback and the note says why."""
    approx = {**PE, "dtype": "float64"}
    c, _, _, s = _clip_problem()
    assert float(compose_polynomials(approx_coefficients(approx), s).max()) > 1.05
    _, _, gaps = _clip_run(approx, realized_reference(approx), c)
    last = gaps["auto"][-1]
    assert last["gap"] == math.inf and last["fallbacks"] >= 1
    assert "outside dom" in last["gap_note"] and "'hidden'" in last["gap_note"]
    assert math.isfinite(gaps["auto"][0]["gap"]) and gaps["auto"][0]["gap_note"] is None


# ---------------------------------------------------------------- diagnostics() on the shipped specs


@pytest.mark.parametrize("name", ["spectral-clip", "prox-muon-frobenius", "hyperball"])
@pytest.mark.parametrize("model_kind", ["mlp", "gpt"])
def test_shipped_specs_report_a_gap_for_every_constrained_rule(name, model_kind):
    """fp32, a few steps: every rule with a constraint (the Newton–Schulz / Polar Express hidden
    matrices; batched buckets, GPT's fused-projection views) reports a finite gap > 0 and no note;
    'declared' and 'realized' agree with it closely (the specs declare the realized barrier); the
    unconstrained rules report None with a note naming the rule and pointing at dual_norm."""
    model = tiny_mlp(0, d_in=8, width=16, depth=4) if model_kind == "mlp" else tiny_gpt(0)
    batch = mlp_batch if model_kind == "mlp" else gpt_batch
    spec = as_spec(SPECS / f"{name}.yaml")
    constrained = {r.name for r in spec.rules if r.constraint is not None}
    assert constrained == {"hidden"}
    opt = geomopt.GeomOptimizer(model, spec, track_gap=True)
    for k in range(4):
        opt.zero_grad()
        loss_of(model, batch(k)).backward()
        diag = opt.diagnostics()
        if k == 0:
            assert diag["hidden"]["gap"] is None and "no W yet" in diag["hidden"]["gap_note"]
        else:
            d = diag["hidden"]
            assert d["gap"] is not None and math.isfinite(d["gap"]) and d["gap"] > 0, d
            assert d["gap_note"] is None and d["fallbacks"] == 0
            for ref in ("declared", "realized"):
                assert opt.diagnostics(gap_reference=ref)["hidden"]["gap"] == pytest.approx(d["gap"], rel=2e-2)
        for rule, d in diag.items():
            if rule in constrained:
                continue
            assert d["gap"] is None and f"'{rule}'" in d["gap_note"] and "dual_norm" in d["gap_note"]
            assert math.isfinite(d["dual_norm"])
        opt.step()


def test_adam_and_untracked_rules_say_why():
    model = tiny_mlp(0, d_in=8, width=16, depth=3)
    opt = geomopt.GeomOptimizer(model, SPECS / "adamw-hybrid.yaml", track_gap=True)
    for k in range(3):
        opt.zero_grad()
        loss_of(model, mlp_batch(k)).backward()
        opt.step()
    opt.zero_grad()
    loss_of(model, mlp_batch(3)).backward()
    diag = opt.diagnostics()
    assert diag["rest"]["gap"] is None and diag["rest"]["dual_norm"] is None
    assert "'rest'" in diag["rest"]["gap_note"] and "adam" in diag["rest"]["gap_note"]
    # proximal decay under Polar Express: measured (against the raw gradient)
    assert math.isfinite(diag["hidden"]["gap"]) and diag["hidden"]["gap"] > 0 and diag["hidden"]["gap_note"] is None

    untracked = geomopt.GeomOptimizer(tiny_mlp(0, d_in=8, width=16, depth=3), SPECS / "hyperball.yaml")
    for p in untracked.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    d = untracked.diagnostics()["hidden"]
    assert d["gap"] is None and "track_gap=True" in d["gap_note"] and "'hidden'" in d["gap_note"]
