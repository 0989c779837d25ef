"""geometry/prox/spectral_map.py: the exact spectral steps (batched Gram–eigh, float64 Gram or the
SVD where float32 is not accurate enough) against the same steps on a float64 numpy SVD, the route
each matrix takes, and its zero, non-finite and overflowing inputs."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

from typed_fragments import backward
from geomopt.geometry.prox.spectral_map import DeviceRoutes
from test_backward import IND, POW4, QUAD, _geometry



def _with_spectrum(sigma: np.ndarray, m: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.standard_normal((m, len(sigma))))[0]
    v = np.linalg.qr(rng.standard_normal((n, len(sigma))))[0]
    return (u * sigma) @ v.T


def _sigma_step_np(c: dict, s: np.ndarray, t: float) -> np.ndarray:
    """The step on σ (sorted descending), written from Table 1: clip, top-k, the linf_sphere step,
    and for the Frobenius ball under the indicator reference max(σ/(1+τ), σ − t) with τ by
    root-finding so that the norm is r."""
    r = c.get("radius")
    if c["kind"] == "stiefel":
        return np.full_like(s, r)
    if c["kind"] == "spectral_ball":
        return np.minimum(s, r)
    if c["kind"] == "rank":
        return np.where(np.arange(len(s)) < c["k"], s, 0.0)
    if c["kind"] == "spectral_sphere":
        return np.minimum(s, r) if s[0] >= r else np.r_[r, s[1:]]
    if np.linalg.norm(s) <= r:
        return s
    if np.linalg.norm(np.maximum(s - t, 0)) > r:  # the ball misses Y + t·dom φ₁: P_C(Y)
        return s * r / np.linalg.norm(s)
    def shrink(tau):
        return np.maximum(s / (1 + tau), s - t)

    tau = so.brentq(lambda tau: np.linalg.norm(shrink(tau)) - r, 0.0, 1e12, xtol=1e-15, rtol=1e-15)
    return shrink(tau)


GRAM_CASES = [
    {"kind": "stiefel", "radius": 1.0},
    {"kind": "spectral_ball", "radius": 1.0},
    {"kind": "spectral_sphere", "radius": 1.0},
    {"kind": "rank", "k": 5},
    {"kind": "frobenius_ball", "radius": 3.0},
]
GRAM_SPECTRA = {
    "near the set": lambda q, rng: np.sort(rng.uniform(0.4, 1.6, q))[::-1],
    "four decades": lambda q, rng: np.logspace(1, -3, q),
    "rank-deficient": lambda q, rng: np.r_[np.sort(rng.uniform(0.5, 2.0, q // 2))[::-1], np.zeros(q - q // 2)],
}


@pytest.mark.parametrize("c,spectrum", [(c, sp) for c in GRAM_CASES for sp in GRAM_SPECTRA
                                         if (c["kind"], sp) != ("stiefel", "rank-deficient")],  # not unique there
                         ids=lambda v: v["kind"] if isinstance(v, dict) else v)
@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (48, 48)])
@pytest.mark.parametrize("routes", ["host", "device"])
def test_exact_spectral_steps_as_accurate_as_a_float32_svd(c, spectrum, shape, routes):
    """The exact steps (batched Gram–eigh where it is as accurate, float64 Gram or the SVD where
    not) against the step done on a float64 numpy SVD of the same float32 Y: max-entry error at
    most 3× that of the same step on torch's float32 SVD (plus 1e-7·‖Y‖₂ for errors both reach
    at rounding level), tall, wide and square. The Frobenius ball's radius and t are set so that
    the step is feasible for the first matrix (the shrink branch). ``device``: the routes chosen on
    the device (:class:`DeviceRoutes`, a capturable step's), the same bound."""
    m, n = shape
    q = min(m, n)
    sigmas = [GRAM_SPECTRA[spectrum](q, np.random.default_rng(k)) for k in range(3)]
    ys = [_with_spectrum(sigma, m, n, k) for k, sigma in enumerate(sigmas)]
    t = 0.05
    if c["kind"] == "frobenius_ball":
        c = dict(c, radius=0.6 * np.linalg.norm(sigmas[0]))
        t = 0.6 * sigmas[0][0]
        assert np.linalg.norm(np.maximum(sigmas[0] - t, 0)) < c["radius"]
    y = torch.tensor(np.stack(ys), dtype=torch.float32)
    geo = _geometry("spectral", IND)
    with DeviceRoutes() if routes == "device" else contextlib.nullcontext():
        x, _ = backward(y, t, geo, c, batch_dims=1)
    exact, svd32 = [], []
    for yi in y:
        u, s, vt = np.linalg.svd(yi.double().numpy(), full_matrices=False)
        exact.append((u * _sigma_step_np(c, s, t)) @ vt)
        u32, s32, vt32 = torch.linalg.svd(yi, full_matrices=False)
        svd32.append((u32 * torch.tensor(_sigma_step_np(c, s32.double().numpy(), t), dtype=torch.float32)) @ vt32)
    exact = torch.tensor(np.stack(exact))
    err = (x.double() - exact).abs().max().item()
    err_svd = (torch.stack(svd32).double() - exact).abs().max().item()
    assert err <= 3 * err_svd + 1e-7 * float(np.linalg.norm(ys[0], 2)), (err, err_svd)


def test_exact_spectral_steps_choose_float32_gram_float64_gram_or_the_svd(monkeypatch):
    """Which way the exact steps go (spy on torch.linalg): σ near the set, one float32 eigh and no
    SVD; σ over four decades, a float64 eigh after the float32 one; a rank cut through equal σ,
    the SVD; Stiefel near the manifold, float32 Gram; Stiefel of a rank-deficient Y (lifts σ = 0,
    whose singular vectors only the SVD completes), the SVD."""
    calls = []
    eigh, svd = torch.linalg.eigh, torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "eigh", lambda a, *k, **kw: calls.append(("eigh", a.dtype)) or eigh(a, *k, **kw))
    monkeypatch.setattr(torch.linalg, "svd", lambda a, *k, **kw: calls.append(("svd", a.dtype)) or svd(a, *k, **kw))
    geo = _geometry("spectral", IND)

    def run(sigma, c):
        calls.clear()
        y = torch.tensor(_with_spectrum(sigma, 64, 32, 0), dtype=torch.float32)
        backward(y, 0.05, geo, c)
        return list(calls)

    near = np.sort(np.random.default_rng(0).uniform(0.6, 1.4, 32))[::-1]
    assert run(near, {"kind": "spectral_ball", "radius": 1.0}) == [("eigh", torch.float32)]
    assert run(np.logspace(1, -3, 32), {"kind": "spectral_ball", "radius": 1.0}) == [
        ("eigh", torch.float32), ("eigh", torch.float64)]
    ties = np.r_[np.ones(8), np.full(24, 0.5)]
    assert run(ties, {"kind": "rank", "k": 4})[-1] == ("svd", torch.float32)
    assert run(near, {"kind": "stiefel", "radius": 1.0}) == [("eigh", torch.float32)]
    deficient = np.r_[near[:16], np.zeros(16)]
    assert run(deficient, {"kind": "stiefel", "radius": 1.0})[-1] == ("svd", torch.float32)


def test_exact_spectral_steps_redo_only_the_matrices_that_need_it(monkeypatch):
    """A Stiefel step on a bucket of a training-like matrix, one with σ over four decades and a
    rank-deficient one: float32 Gram–eigh for all three, float64 for the far one, the SVD for the
    rank-deficient one only (its null directions need LAPACK's completions); each result matches
    the SVD route on that matrix alone."""
    calls = []
    eigh, svd = torch.linalg.eigh, torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "eigh",
                        lambda a, *k, **kw: calls.append(("eigh", a.dtype, len(a))) or eigh(a, *k, **kw))
    monkeypatch.setattr(torch.linalg, "svd",
                        lambda a, *k, **kw: calls.append(("svd", a.dtype, len(a))) or svd(a, *k, **kw))
    near = np.sort(np.random.default_rng(0).uniform(0.6, 1.4, 32))[::-1]
    spectra = [near, np.logspace(1, -3, 32), np.r_[near[:16], np.zeros(16)]]
    y = torch.tensor(np.stack([_with_spectrum(sp, 64, 32, k) for k, sp in enumerate(spectra)]), dtype=torch.float32)
    x, _ = backward(y, 0.05, _geometry("spectral", IND), {"kind": "stiefel", "radius": 2.0}, batch_dims=1)
    # the rank-deficient one goes straight to the SVD where its null σ round to exactly 0, else
    # after a float64 attempt
    assert calls[0] == ("eigh", torch.float32, 3) and calls[-1] == ("svd", torch.float32, 1), calls
    assert calls[1:-1] in ([("eigh", torch.float64, 1)], [("eigh", torch.float64, 2)]), calls
    for k in range(3):
        u, _, vh = svd(y[k].double() if k < 2 else y[k], full_matrices=False)  # the last: the float32 SVD's completions
        assert (x[k].double() - 2 * (u @ vh).double()).abs().max().item() < 2e-5, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("routes", ["host", "device"])
def test_exact_spectral_steps_at_zero_keep_the_identity_frame(dtype, routes):
    """Y = 0 (σ all zero, no singular vectors to read off a Gram matrix): the identity frame of
    the documented convention, as the SVD path gives it."""
    z = torch.zeros(2, 5, 3, dtype=dtype)
    geo = _geometry("spectral", IND)
    routing = DeviceRoutes() if routes == "device" else contextlib.nullcontext()
    with routing:
        x, _ = backward(z, 0.1, geo, {"kind": "spectral_sphere", "radius": 2.0}, batch_dims=1)
    expected = torch.zeros(5, 3, dtype=dtype)
    expected[0, 0] = 2.0
    torch.testing.assert_close(x, expected.expand(2, 5, 3))
    for c in ({"kind": "spectral_ball", "radius": 2.0}, {"kind": "rank", "k": 1},
              {"kind": "frobenius_ball", "radius": 1.0}):
        with routing:
            x, _ = backward(z, 0.1, geo, c, batch_dims=1)
        assert torch.equal(x, z), c


SPECTRAL_SETS = [{"kind": "spectral_ball", "radius": 2.0}, {"kind": "spectral_sphere", "radius": 2.0},
                 {"kind": "rank", "k": 1}, {"kind": "stiefel", "radius": 1.0, "method": "exact"},
                 {"kind": "frobenius_ball", "radius": 1.0}, {"kind": "frobenius_sphere", "radius": 1.0}]


@pytest.mark.parametrize("c", SPECTRAL_SETS, ids=lambda c: c["kind"])
@pytest.mark.parametrize("ref", [IND, POW4], ids=["indicator", "pow4"])
def test_exact_spectral_steps_of_a_nonfinite_matrix_are_nan(c, ref):
    """A matrix holding a NaN or ±∞ (a NaN gradient under ``on_nonfinite: off``) gives a NaN X, as
    a matmul would, where LAPACK's SVD and eigh raised; the batch's finite matrices step as alone,
    bit for bit."""
    y = torch.randn(3, 5, 3, generator=torch.Generator().manual_seed(4))
    y[1, 2, 1], y[2, 0, 0] = math.nan, math.inf
    geo = _geometry("spectral", ref)
    x, _ = backward(y, 0.1, geo, c, batch_dims=1)
    alone, _ = backward(y[:1], 0.1, geo, c, batch_dims=1)
    assert torch.equal(x[:1], alone)
    assert x[1:].isnan().all()


def test_exact_spectral_steps_where_the_gram_matrix_overflows_take_the_svd():
    """Columns past √max (1.8e19 in float32) overflow the Gram matrix's diagonal while some of its
    off-diagonal entries stay finite: eigh did not converge on what was left of it (the whole Gram
    matrix is now set aside and the SVD taken). X is finite and in the set; the batch's other
    matrix steps as alone, bit for bit."""
    y = torch.zeros(2, 20, 16)
    y[0] = torch.randn(20, 16, generator=torch.Generator().manual_seed(5))
    y[1, 2, 2] = 1e25
    for col, v in [(0, 6.0727475), (8, 0.76878495), (14, -1.5908714)]:
        y[1, 2, col], y[1, col + 1 if col == 2 else col, col] = v, 1e25
    for c, size in (({"kind": "frobenius_ball", "radius": 1.0}, lambda m: torch.linalg.matrix_norm(m)),
                    ({"kind": "spectral_ball", "radius": 2.0}, lambda m: torch.linalg.matrix_norm(m, 2))):
        x, _ = backward(y, 0.1, _geometry("spectral", POW4), c, batch_dims=1)
        alone, _ = backward(y[:1], 0.1, _geometry("spectral", POW4), c, batch_dims=1)
        assert x.isfinite().all() and torch.equal(x[:1], alone), c
        assert float(size(x[1].double())) <= c["radius"] * (1 + 1e-5), c


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tiny", [2.08e-157, 1e-30, 1e-12, 0.0])
def test_stiefel_projection_of_a_nearly_rank_deficient_matrix_is_on_the_manifold(dtype, tiny):
    """The last σ of Y = [0; 0; (1, tiny)] is below the Gram matrix's resolution: the projection must
    still be r·(orthonormal columns) (LAPACK's completion), not M·v/σ of rounding noise, and a fixed
    point (found by hypothesis in test_euclidean_projection_idempotent)."""
    y = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, tiny]], dtype=torch.float64).to(dtype)
    c = {"kind": "stiefel", "radius": 0.9}
    x, _ = backward(y, 0.3, _geometry("euclidean", QUAD), c)
    r = c["radius"]
    torch.testing.assert_close(x.double().T @ x.double(), r * r * torch.eye(2, dtype=torch.float64),
                               rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    xx, _ = backward(x, 0.3, _geometry("euclidean", QUAD), c)
    torch.testing.assert_close(xx, x, rtol=1e-5, atol=1e-6)
