"""geometry/prox/polar.py: the SVD-free (Newton–Schulz, Gram inverse square root) polar factors of
the Stiefel and spectral-ball steps, their max-entry error against the SVD's steps in float64, and
the iteration's step counts and safeguards against independent computations."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from typed_fragments import backward
from geomopt.geometry.prox.polar import polar, polar_steps
from test_backward import LOG, _geometry, direction, point_in



@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("shape", [(48, 24), (24, 48), (256, 128), (128, 512)])
@pytest.mark.parametrize("gamma", [0.6, 0.04, 0.002])  # t = 0.3r (a loose Gershgorin guard), 0.02r, 0.001r
def test_stiefel_polar_accuracy(dtype, bound, shape, gamma):
    """r·polar(Y) for Y = X − tW, X ∈ Stiefel(r), ‖W‖₂ < 1: max-entry error vs the SVD ≤ bound·r."""
    rng = np.random.default_rng(5)
    r = 2.0
    y = np.stack([point_in({"kind": "stiefel", "radius": r}, shape, rng)
                  - gamma * direction("spectral", shape, rng, 0.99)
                  for _ in range(3)])
    geo = _geometry("spectral", LOG)
    exact, _ = backward(torch.tensor(y), gamma, geo, {"kind": "stiefel", "radius": r}, batch_dims=1)
    approx, fb = backward(torch.tensor(y, dtype=dtype), gamma, geo, {"kind": "stiefel", "radius": r, "method": "polar"},
                          batch_dims=1)
    err = (approx.double() - exact).abs().max().item() / r
    assert err <= bound, err
    assert not fb.any()


@pytest.mark.parametrize("shape,gram_route", [((128, 512), True), ((512, 128), True), ((128, 128), False)])
def test_stiefel_polar_takes_the_cheaper_iteration(shape, gram_route, monkeypatch):
    """Near Stiefel, elongated matrices go through the Gram matrix's inverse square root (fewer
    FLOPs), square ones through Newton–Schulz on Y; both match r·U·Vᵀ of the SVD to ≤ 2e-6·r."""
    mod = importlib.import_module("geomopt.geometry.prox.polar")
    calls = []
    inverse_sqrt = mod._inverse_sqrt
    monkeypatch.setattr(mod, "_inverse_sqrt", lambda *a, **k: calls.append(1) or inverse_sqrt(*a, **k))
    rng = np.random.default_rng(11)
    r, gamma = 2.0, 0.04
    y = np.stack([point_in({"kind": "stiefel", "radius": r}, shape, rng)
                  - gamma * direction("spectral", shape, rng, 0.99)
                  for _ in range(2)])
    geo = _geometry("spectral", LOG)
    exact, _ = backward(torch.tensor(y), gamma, geo, {"kind": "stiefel", "radius": r}, batch_dims=1)
    approx, _ = backward(torch.tensor(y, dtype=torch.float32), gamma, geo,
                         {"kind": "stiefel", "radius": r, "method": "polar"}, batch_dims=1)
    assert bool(calls) == gram_route
    assert (approx.double() - exact).abs().max().item() / r <= 2e-6


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("shape,rank", [((40, 24), None), ((24, 40), None), ((40, 24), 5)])
@pytest.mark.parametrize("r", [4.0, 0.02])
def test_spectral_ball_polar_accuracy(dtype, bound, shape, rank, r):
    """SVD-free clipping vs SVD clipping at r = 4 and 0.02 (Y scaled with r): max-entry error ≤ bound·r
    on Gaussian and rank-deficient matrices (rank-deficient inputs are where the ½[Y + rQ − PQᵀ(Y − rQ)]
    form loses ~1e-1·r in fp32 with an iterative polar; see _spectral_ball_polar)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    if rank is not None:
        y = y[..., :rank] @ torch.randn(3, rank, shape[1], generator=g, dtype=torch.float64)
    y = y * (r / 4.0)  # σ(Y) spreads over (0, ~3.3r): some clipped, some not
    geo = _geometry("spectral", LOG)
    exact, _ = backward(y, 0.5, geo, {"kind": "spectral_ball", "radius": r}, batch_dims=1)
    approx, _ = backward(y.to(dtype), 0.5, geo, {"kind": "spectral_ball", "radius": r, "method": "polar"}, batch_dims=1)
    assert approx.dtype == dtype
    err = (approx.double() - exact).abs().max().item() / r
    assert err <= bound, err


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("shape", [(256, 128), (128, 512)])
@pytest.mark.parametrize("gamma", [0.6, 0.04, 0.002])  # t = 0.3r, 0.02r, 0.001r
def test_spectral_ball_polar_accuracy_on_training_steps(dtype, bound, shape, gamma):
    """Y = X − tW, X in the spectral ball (σ uniform in [0, r]), ‖W‖₂ < 1: the clipping's
    max-entry error vs the SVD ≤ bound·r (its step counts adapt to the Gram matrix's scales)."""
    rng = np.random.default_rng(7)
    r = 2.0
    y = []
    for _ in range(3):
        u = np.linalg.qr(rng.standard_normal((shape[0], min(shape))))[0]
        v = np.linalg.qr(rng.standard_normal((shape[1], min(shape))))[0]
        y.append((u * rng.uniform(0, r, min(shape))) @ v.T - gamma * direction("spectral", shape, rng, 0.99))
    y = np.stack(y)
    geo = _geometry("spectral", LOG)
    c = {"kind": "spectral_ball", "radius": r}
    exact, _ = backward(torch.tensor(y), gamma, geo, c, batch_dims=1)
    approx, fb = backward(torch.tensor(y, dtype=dtype), gamma, geo, dict(c, method="polar"), batch_dims=1)
    err = (approx.double() - exact).abs().max().item() / r
    assert err <= bound, err
    assert not fb.any()


def test_polar_identity_for_clipping_holds_exactly_with_svd_polar():
    """The clipping identity itself (_spectral_ball_polar's docstring) with exact polar factors: equality to
    rounding."""
    y = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = 1.3

    def pol(m):
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        return u @ vh

    q = pol(y)
    p = pol(y - r * q)
    clip = 0.5 * (y + r * q - p @ q.T @ (y - r * q))
    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    torch.testing.assert_close(clip, (u * s.clamp(max=r)) @ vh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(polar(y), q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.float64, 1e-12)])
def test_spectral_ball_polar_far_outside_the_ball(dtype, bound):
    """σ(Y) from 100r down to 0.01r (no feasibility to lean on, e.g. backward_step on any Y):
    the polar factors' floors are relative to the scale, not to r, so clipping stays accurate."""
    g = torch.Generator().manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(3, 64, 32, generator=g, dtype=torch.float64), full_matrices=False)
    s = torch.logspace(-2, 2, 32, dtype=torch.float64).flip(0).expand(3, 32)
    y = u @ torch.diag_embed(s) @ vh
    geo = _geometry("spectral", LOG)
    exact, _ = backward(y, 0.01, geo, {"kind": "spectral_ball", "radius": 1.0}, batch_dims=1)
    approx, _ = backward(y.to(dtype), 0.01, geo, {"kind": "spectral_ball", "radius": 1.0, "method": "polar"},
                         batch_dims=1)
    assert (approx.double() - exact).abs().max().item() <= bound


# ---------------------------------------------------------------- the iterations at their contracts' ends


def _spectrum_matrix(sigma: np.ndarray, m: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.standard_normal((m, len(sigma))))[0]
    v = np.linalg.qr(rng.standard_normal((n, len(sigma))))[0]
    return (u * sigma) @ v.T


def _svd_polar(m: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(m, full_matrices=False)
    return u @ vt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(24, 10), (10, 24)])
@pytest.mark.parametrize("floor,top", [(1e-3, 1.5), (0.05, 1.0), (0.3, 0.9), (2.0**-20, 1.2)])
def test_scaled_polar_at_the_ends_of_its_contract(dtype, shape, floor, top):
    """polar(M, scale=c, floor=f, top=T) for σ(M)/c spread over [f, T] with both ends taken (the
    caller's guarantee, polar's docstring): the SVD's U·Vᵀ in float64 to ≤ 4u/f per entry (the polar
    factor's own conditioning, u/σ_min: measured ≤ 1.0u/f); the unscaled iteration (steps from
    :func:`polar_steps`) the same on σ/‖M‖_F ∈ [f', 1], f' its smallest."""
    u = torch.finfo(dtype).eps
    q = min(shape)
    c = 3.0
    scales = [np.geomspace(top, floor, q), np.r_[top, np.full(q - 2, 0.5 * (top + floor)), floor]]
    m = np.stack([_spectrum_matrix(c * s, *shape, k) for k, s in enumerate(scales)])
    want = np.stack([_svd_polar(mk) for mk in m])
    got = polar(torch.tensor(m, dtype=dtype), scale=torch.full((2, 1, 1), c, dtype=dtype), floor=floor, top=top)
    assert got.dtype == dtype
    assert np.abs(got.double().numpy() - want).max() <= 4 * u / floor
    fro = np.stack([s / np.linalg.norm(s) for s in scales])
    m = np.stack([_spectrum_matrix(s, *shape, k) for k, s in enumerate(fro)])
    low = min(float(s[-1]) for s in fro)
    want = np.stack([_svd_polar(mk) for mk in m])
    got = polar(torch.tensor(m, dtype=dtype), floor=low)
    assert np.abs(got.double().numpy() - want).max() <= 4 * u / low
    one = polar(torch.tensor(m[1], dtype=dtype), floor=low)  # a single matrix, and a stack of stacks
    assert one.shape == m[1].shape and np.abs(one.double().numpy() - want[1]).max() <= 4 * u / low
    four = polar(torch.tensor(np.stack([m, m[::-1]]), dtype=dtype), floor=low)
    assert np.abs(four.double().numpy() - np.stack([want, want[::-1]])).max() <= 4 * u / low
    if low >= (2.0**-40 if dtype == torch.float64 else 2.0**-20):  # within the default floor
        assert np.abs(polar(torch.tensor(m, dtype=dtype)).double().numpy() - want).max() <= 4 * u / low


def _cubic_steps_np(x: float, eps: float) -> int:
    n = 0
    while abs(1 - x) > eps and n < 1000:
        x = 1.5 * x - 0.5 * x**3
        n += 1
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("floor,top", [(1e-6, 1.0), (0.2, 1.6), (0.9, 1.1), (1.0, 1.0)])
def test_polar_steps_counts_the_slower_end(dtype, floor, top):
    """polar_steps: one more than the cubic map's steps for the slower of σ = floor and σ = top to
    come within ε of 1 (counted here in Python floats), and those steps bring both there."""
    eps = torch.finfo(dtype).eps
    n = polar_steps(floor, dtype, top)
    assert n == max(_cubic_steps_np(floor, eps), _cubic_steps_np(top, eps)) + 1
    for x in (floor, top):
        for _ in range(n - 1):
            x = 1.5 * x - 0.5 * x**3
        assert abs(1 - x) <= eps


def test_spectral_norm_estimate_of_tall_and_wide_matrices():
    """The power-iteration estimate of σ_max: for a matrix whose top singular value is separated
    (σ₁/σ₂ = 4) it is σ₁ to 1e-6 after its 12 iterations, tall or wide, and never above σ₁."""
    mod = importlib.import_module("geomopt.geometry.prox.polar")
    sig = np.r_[8.0, 2.0, 1.5, 1.0, 0.5, 0.1]
    for shape in ((15, 6), (6, 15)):
        e = torch.tensor(np.stack([_spectrum_matrix(sig * (k + 1), *shape, k) for k in range(3)]))
        est = mod._spectral_norm_estimate(e)
        want = torch.tensor([8.0, 16.0, 24.0], dtype=torch.float64)
        assert torch.all(est <= want * (1 + 1e-12)) and torch.allclose(est, want, rtol=1e-6, atol=0), (shape, est)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gram_route_converges_at_the_top_of_its_interval(dtype, monkeypatch):
    """_polar_by_cost on a 512×8 matrix (the Gram matrix's inverse square root is the cheaper route)
    with σ/c spread over [0.999, 1.5], both ends taken: the top end, not the floor, needs the steps;
    U·Vᵀ of the float64 SVD to ≤ 8u per entry."""
    mod = importlib.import_module("geomopt.geometry.prox.polar")
    c, floor, top = 2.0, 0.999, 1.5
    sigma = c * np.r_[top, np.linspace(1.3, 1.0, 6), floor]
    m = _spectrum_matrix(sigma, 512, 8, 4)[None]
    mats = torch.tensor(m, dtype=dtype)
    calls = []
    inverse_sqrt = mod._inverse_sqrt
    monkeypatch.setattr(mod, "_inverse_sqrt", lambda *a, **k: calls.append(1) or inverse_sqrt(*a, **k))
    got = mod._polar_by_cost(mats, mats.mT @ mats, torch.full((1, 1, 1), c, dtype=dtype), floor, top)
    assert calls
    assert np.abs(got.double().numpy() - _svd_polar(m[0])[None]).max() <= 8 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("shape", [(48, 24), (24, 48)])
def test_stiefel_polar_with_a_step_past_the_radius(dtype, bound, shape):
    """t ≥ r/1.2 (nothing to lean on from feasibility: the iteration runs from the dtype's default
    floor): a Gaussian Y's r·polar(Y) against the SVD's, max-entry error ≤ bound·r (measured 4.6e-7,
    2.2e-15)."""
    y = torch.randn(2, *shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r, t = 1.0, 3.0
    geo = _geometry("spectral", LOG)
    exact, _ = backward(y, t, geo, {"kind": "stiefel", "radius": r}, batch_dims=1)
    approx, _ = backward(y.to(dtype), t, geo, {"kind": "stiefel", "radius": r, "method": "polar"}, batch_dims=1)
    assert (approx.double() - exact).abs().max().item() <= bound * r
