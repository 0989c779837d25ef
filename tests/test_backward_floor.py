"""The exact spectral steps at the eigensolver floor and the Frobenius ball's Newton solve.

The ball's scalar solve (geomopt.geometry.prox.scalar._solve_ball: safeguarded Newton on τ, fixed
step count) against an independent float64 root finding written from the optimality conditions
(scipy brentq for σ_i and for τ), for every reference it supports; then the batched Gram–eigh
steps (low-rank composition, routes) against a float64 SVD of the same matrices.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

import typed_fragments as typed
from typed_fragments import backward
from geomopt.geometry.reference import make_reference

scalar = importlib.import_module("geomopt.geometry.prox.scalar")
vector = importlib.import_module("geomopt.geometry.prox.vector")
spectral_map = importlib.import_module("geomopt.geometry.prox.spectral_map")

REFS = {
    "pow1": {"kind": "power_barrier", "kappa": 1.0, "eps": 1e-3},
    "pow2": {"kind": "power_barrier", "kappa": 2.0, "eps": 1e-3},
    "pow4": {"kind": "power_barrier", "kappa": 4.0, "eps": 1e-3},
    "pow16": {"kind": "power_barrier", "kappa": 16.0, "eps": 1e-3},
    "log": {"kind": "log_barrier", "eps": 1e-3},
    "indicator": {"kind": "indicator"},
}


# ---------------------------------------------------------------- float64 brute force


def _dual(ref: dict, y: float) -> float:
    """(h₁*)'(y) for y ≥ 0 at ε = 1, from the references' definitions."""
    if ref["kind"] == "log_barrier":
        return y / (1 + y)
    if ref["kind"] == "indicator":
        return min(y, 1.0)
    k = ref["kappa"]
    return y / (1 + y**k) ** (1 / k) if y <= 1 else (1 + y ** -k) ** (-1 / k)


def _sigma(ref: dict, alpha: np.ndarray, tau: float) -> np.ndarray:
    """σ_i + (h₁*)'(τσ_i) = α_i, σ_i ∈ [0, α_i], by brentq per entry (the left side increases in σ)."""
    out = np.zeros_like(alpha)
    for i, a in enumerate(alpha):
        if a > 0:
            out[i] = so.brentq(lambda s: s + _dual(ref, tau * s) - a, 0.0, a, xtol=1e-300, rtol=1e-15, maxiter=500)
    return out


def _ball_brute(ref: dict, a: np.ndarray, t: float, r: float) -> np.ndarray:
    """The ℓ2-ball step's magnitudes: τ by brentq on log τ so that Σ(tσ)² = r² (Σσ² decreases in τ)."""
    alpha, rho2 = a / t, (r / t) ** 2
    f = lambda lt: float(np.sum(_sigma(ref, alpha, math.exp(lt)) ** 2) - rho2)
    lo, hi = -60.0, 60.0
    assert f(lo) > 0 > f(hi)
    lt = so.brentq(f, lo, hi, xtol=1e-14, rtol=1e-15, maxiter=500)
    s = t * _sigma(ref, alpha, math.exp(lt))
    return s * (r / np.linalg.norm(s))  # the root's last digits: onto the ball, as the op lands


def _magnitudes(kind: str, n: int, rng) -> np.ndarray:
    return {"uniform": lambda: rng.uniform(0, 1, n), "spread": lambda: np.logspace(1, -3, n) * rng.uniform(0.5, 1.5, n),
            "two": lambda: np.r_[5.0, 1.0, np.zeros(n - 2)]}[kind]()


def _scaled(b: np.ndarray, t: float, r: float, theta: float) -> np.ndarray:
    """b scaled between ‖a‖ = r (θ = 0: no step) and Σ(a − t)₊² = r² (θ = 1: the ball barely in reach)."""
    s0, s1 = r / np.linalg.norm(b), so.brentq(lambda s: np.linalg.norm(np.maximum(s * b - t, 0)) - r, r / np.linalg.norm(b), 1e12)
    return (s0 + theta * (s1 - s0)) * b


CASES = [(ref, dist, t_over_r, theta) for ref in REFS for dist in ("uniform", "spread", "two")
         for t_over_r in (1e-3, 0.1, 1.0, 5.0) for theta in (0.01, 0.5, 0.99)]


@pytest.mark.parametrize("ref,dist,t_over_r,theta", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_ball_newton_matches_float64_brute_force(ref, dist, t_over_r, theta):
    """float64: ≤ 1e-12 relative to the largest magnitude (measured: ≤ 4e-15); float32 (the
    float32-rounded input's own solution as reference): ≤ 1e-5 (measured: ≤ 1.1e-6, the float32
    conditioning of Σσ² = ρ² near the box, θ = 0.99)."""
    rng = np.random.default_rng(7)
    r = 1.0
    t = t_over_r * r
    a = _scaled(_magnitudes(dist, 40, rng), t, r, theta)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        at = torch.tensor(a, dtype=dtype)[None]
        s, bad = scalar.ball_magnitudes(at, t, r, make_reference(typed.reference(REFS[ref])), dtype)
        assert not bool(bad[0])
        want = _ball_brute(REFS[ref], at[0].double().numpy(), t, r)
        err = np.abs(s[0].double().numpy() - want).max() / want.max()
        assert err <= tol, (dtype, err)


def test_ball_solve_has_no_host_syncs():
    """Fixed step count, no data-dependent control flow: the whole solve runs on the meta device
    (any .item(), .tolist() or bool() of a tensor would raise there)."""
    for ref in REFS.values():
        h = make_reference(typed.reference(ref))
        s, bad = scalar.ball_magnitudes(torch.empty(3, 7, device="meta"), 0.1, 1.0, h, torch.float32)
        assert s.shape == (3, 7) and bad.shape == (3,)


def test_ball_rows_are_independent_and_flags_unchanged():
    """Rows inside the ball come back unchanged, infeasible rows get the Euclidean projection and
    the flag, and a row's result does not depend on the rows next to it (bit for bit)."""
    rng = np.random.default_rng(3)
    a = torch.tensor(np.stack([rng.uniform(0, 1, 16) * k for k in (0.1, 0.4, 1.0, 5.0)]), dtype=torch.float32)
    ref = make_reference(typed.reference(REFS["pow4"]))
    s, bad = scalar.ball_magnitudes(a, 0.3, 1.0, ref, torch.float32)
    assert torch.equal(s[0], a[0]) and not bool(bad[0])
    assert bool(bad[3]) and torch.allclose(s[3], a[3] / a[3].norm())
    for i in range(4):
        si, bi = scalar.ball_magnitudes(a[i:i + 1], 0.3, 1.0, ref, torch.float32)
        assert torch.equal(si[0], s[i]) and bool(bi[0]) == bool(bad[i])


# ---------------------------------------------------------------- the batched Gram–eigh steps

GEOMETRY = {"kind": "spectral", "reference": REFS["pow4"], "approx": {"kind": "svd"}, "radius": 1.0}
STEPS = [{"kind": "frobenius_ball", "radius": 2.0}, {"kind": "frobenius_ball", "radius": 6.0},
         {"kind": "rank", "k": 6}, {"kind": "spectral_sphere", "radius": 0.5}, {"kind": "spectral_sphere", "radius": 30.0},
         {"kind": "spectral_ball", "radius": 0.5}]


def _buckets(shape, batch=4):
    """The benchmark's two kinds of Y (benchmarks/backward.py), float64: Gaussian (σ near the sets)
    and σ spread over four decades."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(batch, *shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5
    u, _, vh = torch.linalg.svd(base, full_matrices=False)
    return {"near": base, "far": (u * torch.logspace(1, -3, min(shape), dtype=torch.float64)) @ vh}


def _step_values(s: torch.Tensor, c: dict, t: float) -> torch.Tensor:
    """The op's own scalar step on σ, in float64."""
    if c["kind"] == "frobenius_ball":
        ref = make_reference(typed.reference(GEOMETRY["reference"]))
        return scalar.ball_magnitudes(s.double(), t, c["radius"], ref, torch.float64)[0]
    return vector.sigma_proj(c["kind"], s.double(), typed.constraint(c))


def _svd_step(y: torch.Tensor, c: dict, t: float) -> torch.Tensor:
    """The same step through an SVD of y in y's dtype: U·Diag(x(σ))·Vᵀ."""
    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    return (u * _step_values(s, c, t).to(y.dtype)[:, None, :]) @ vh


@pytest.mark.parametrize("shape", [(96, 48), (48, 96)])
@pytest.mark.parametrize("c", STEPS, ids=lambda c: f"{c['kind']}-{c.get('radius', c.get('k'))}")
def test_exact_steps_match_float64_svd(c, shape):
    """float32 Y: the batched step against the float64 SVD of the same Y, at most 3× the float32
    SVD's own error plus 1e-7·‖Y‖₂ (σ near the set); with σ over four decades the steps that need
    it go through float64 and stay at that level (≤ 1e-8·‖Y‖₂: float32 output rounding)."""
    t = 0.05
    for label, y64 in _buckets(shape).items():
        y = y64.float()
        want = _svd_step(y.double(), c, t)
        x, _ = backward(y, t, GEOMETRY, c, batch_dims=1)
        err = (x.double() - want).abs().max().item()
        err_svd = (_svd_step(y, c, t).double() - want).abs().max().item()
        bound = 3 * err_svd + 1e-7 * float(torch.linalg.matrix_norm(y, ord=2).max())
        assert err <= bound, (label, err, err_svd)


def test_far_clipping_keeps_the_float64_route():
    """σ over four decades, clipped at 0.5: the float32 Gram cannot resolve it (u·λ_max), the
    float64 one does; the result stays at float32 output rounding against a float64 SVD."""
    y = _buckets((96, 48))["far"].float()
    for c in ({"kind": "spectral_ball", "radius": 0.5}, {"kind": "spectral_sphere", "radius": 0.5}):
        x, _ = backward(y, 0.05, GEOMETRY, c, batch_dims=1)
        assert (x.double() - _svd_step(y.double(), c, 0.05)).abs().max().item() <= 1e-8, c


def test_frobenius_projection_is_a_scaling(monkeypatch):
    """Y far outside the Frobenius ball (the step is the Euclidean projection r·Y/‖Y‖): every w is
    the same, so no float64 redo and the result is that scaling of Y, to float32 rounding."""
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a, *k, **kw: calls.append(a.dtype) or eigh(a, *k, **kw))
    for y64 in _buckets((96, 48)).values():
        calls.clear()
        y = y64.float()
        x, bad = backward(y, 0.05, GEOMETRY, {"kind": "frobenius_ball", "radius": 2.0}, batch_dims=1)
        assert calls == [torch.float32] and bool(bad.all())
        scale = 2.0 / torch.linalg.matrix_norm(y.double())[:, None, None]
        assert (x.double() - y.double() * scale).abs().max().item() <= 4e-7 * float(y.abs().max())


@pytest.mark.parametrize("c", [{"kind": "spectral_sphere", "radius": 10.0}, {"kind": "rank", "k": 1},
                               {"kind": "rank", "k": 2}, {"kind": "spectral_ball", "radius": 0.5},
                               {"kind": "frobenius_ball", "radius": 1.0}], ids=lambda c: c["kind"] + str(c.get("k", "")))
@pytest.mark.parametrize("shape", [(72, 24), (24, 72)])
def test_each_matrix_independent_of_its_batch(c, shape):
    """A matrix's result does not depend on the other matrices of its bucket, bit for bit (the
    low-rank width is rounded up per matrix to a multiple of 8, never 1: a one-column product takes
    another kernel for a batch of one); distributed owners rely on it."""
    y = _buckets(shape, batch=3)["near"].float()
    x, _ = backward(y, 0.05, GEOMETRY, c, batch_dims=1)
    for i in range(3):
        assert torch.equal(x[i], backward(y[i], 0.05, GEOMETRY, c)[0]), i


def test_low_rank_composition_equals_the_frame():
    """c·M + (M·V_K)·Diag(w_K − c)·V_Kᵀ and M·V·Diag(w)·Vᵀ agree to rounding, tall and wide."""
    g = torch.Generator().manual_seed(2)
    for shape in ((40, 16), (16, 40)):
        m = torch.randn(3, *shape, generator=g, dtype=torch.float64)
        q = min(shape)
        v = torch.linalg.qr(torch.randn(3, q, q, generator=g, dtype=torch.float64))[0]
        c = torch.tensor([[0.5], [1.0], [0.0]], dtype=torch.float64)
        w = c.expand(3, q).clone()
        w[:, :5] = torch.rand(3, 5, generator=g, dtype=torch.float64)
        frame = (v, w, c)
        low = spectral_map._gram_product(m, None, frame, 8, [False] * 3)
        full = spectral_map._gram_product(m, None, frame, q, [False] * 3)
        torch.testing.assert_close(low, full, rtol=1e-12, atol=1e-12)


def test_underflowing_gram_goes_to_the_svd(monkeypatch):
    """‖Y‖ so small that YᵀY's products underflow in float32: the SVD, and the right answer."""
    calls = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda a, *k, **kw: calls.append(a.dtype) or svd(a, *k, **kw))
    y = _buckets((24, 12), batch=2)["near"].float() * 1e-22
    c = {"kind": "stiefel", "radius": 1.0}
    x, _ = backward(y, 0.05, {**GEOMETRY, "reference": REFS["log"]}, c, batch_dims=1)
    assert calls
    u, _, vh = svd(y.double(), full_matrices=False)
    assert (x.double() - u @ vh).abs().max().item() < 1e-5
