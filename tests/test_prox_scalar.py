"""geometry/prox/scalar.py: the steps on magnitudes (the ℓ2-ball and sphere solves, the box
thresholds, the scalar duals' Newton iterations) against nested scipy root-finding and closed forms
in float64."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import scipy.optimize as so
import torch

import typed_fragments as typed
from test_backward import LOG, POW4



@pytest.mark.parametrize("ref", [LOG, POW4, {"kind": "power_barrier", "kappa": 1.0, "eps": 1e-3}],
                         ids=["log", "pow4", "pow1"])
@pytest.mark.parametrize("t_over_r", [1e-3, 0.3, 5.0])
def test_ball_magnitudes_match_nested_root_finding_in_float64(ref, t_over_r):
    """The ℓ2-ball step on magnitudes (bisection on log τ, then the interpolation) against nested
    scipy root-finding written from the optimality conditions: σ + (h₁*)'(τσ) = α per entry (h₁ with
    ε = 1: (h₁*)'(y) = y/(1 + y^κ)^{1/κ}, log barrier y/(1 + y)), τ such that Σσ² = (r/t)².
    Relative error ≤ 1e-12 in float64."""
    mod = importlib.import_module("geomopt.geometry.prox.scalar")
    from geomopt.geometry.reference import make_reference

    kappa = ref.get("kappa")
    dual = (lambda y: y / (1 + y)) if ref["kind"] == "log_barrier" else (lambda y: y / (1 + y**kappa) ** (1 / kappa))
    rng = np.random.default_rng(3)
    r = 1.0
    t = t_over_r * r
    a = rng.uniform(0, 3, 24)
    a *= (r + 0.3 * t) / np.linalg.norm(a)  # outside the ball, within reach: the shrink branch
    alpha, rho = a / t, r / t

    def sigma(tau):
        return np.array([0.0 if al == 0 else so.brentq(lambda s, al=al: s + dual(tau * s) - al, 0.0, al, xtol=1e-300,
                                                       rtol=1e-15)
                         for al in alpha])

    assert np.sum(np.maximum(a - t, 0) ** 2) <= r * r
    log_tau = so.brentq(lambda lt: np.sum(sigma(np.exp(lt)) ** 2) - rho**2, -40, 40, xtol=1e-15, rtol=1e-15)
    s, bad = mod.ball_magnitudes(torch.tensor(a)[None], t, r, make_reference(typed.reference(ref)), torch.float64)
    assert not bool(bad[0])
    np.testing.assert_allclose(s[0].numpy(), t * sigma(np.exp(log_tau)), rtol=1e-12, atol=1e-14 * r)


# ---------------------------------------------------------------- ball and sphere, every branch, float64 and float32


def _unit_dual_np(ref: dict):
    """(h₁*)' with ε = 1, from h directly: the log barrier y/(1 + y), the power barrier
    y/(1 + y^κ)^{1/κ}, the indicator min(y, 1)."""
    if ref["kind"] == "log_barrier":
        return lambda y: y / (1 + y)
    if ref["kind"] == "indicator":
        return lambda y: min(y, 1.0)
    k = ref["kappa"]
    return lambda y: y / (1 + y**k) ** (1 / k) if y <= 1 else (1 + y**-k) ** (-1 / k)


def _magnitudes_np(a: np.ndarray, t: float, r: float, ref: dict, outward: bool) -> np.ndarray:
    """One row's step on magnitudes in float64 from the optimality conditions: σ_i + c·(h₁*)'(τσ_i) =
    a_i/t per entry (c = +1, σ ∈ [0, α] for the ball; c = −1, σ ∈ [α, α + 1] for the sphere's outward
    step: the largest root), and τ such that Σ(tσ)² = r², each by scipy's brentq."""
    f = _unit_dual_np(ref)
    alpha, rho2 = a / t, (r / t) ** 2

    def sigma(tau):
        if outward:  # σ = α + δ, δ ∈ [0, 1]: δ = (h₁*)'(τσ) ≤ 1
            return alpha + np.array([so.brentq(lambda d, al=al: d - min(f(tau * (al + d)), 1.0), 0.0, 1.0,
                                               xtol=1e-300, rtol=1e-15) for al in alpha])
        return np.array([so.brentq(lambda s, al=al: s + f(tau * s) - al, 0.0, al, xtol=1e-300, rtol=1e-15)
                         for al in alpha])

    log_tau = so.brentq(lambda lt: np.sum(sigma(np.exp(lt)) ** 2) - rho2, -60, 60, xtol=1e-15, rtol=1e-15)
    return t * sigma(np.exp(log_tau))


REFS = {"log": LOG, "pow4": POW4, "pow1": {"kind": "power_barrier", "kappa": 1.0, "eps": 1e-3},
        "pow3": {"kind": "power_barrier", "kappa": 3.0, "eps": 1e-3},
        "pow64": {"kind": "power_barrier", "kappa": 64.0, "eps": 1e-3}, "indicator": {"kind": "indicator"}}


def _rows(t: float, r: float) -> np.ndarray:
    """Four rows of 12 magnitudes > 0: outside the ball within reach (the shrink), inside (the
    ball keeps it; the sphere steps outward), inside but out of reach of the sphere, beyond reach of
    the ball (both: the Euclidean projection, flagged)."""
    rng = np.random.default_rng(8)
    rows = []
    # the third: ‖a + t‖ < r where t is small enough for it (else another row the outward step reaches)
    for scale in (r + 0.4 * t, max(r - 0.3 * t, 0.5 * r), max(0.5 * (r - t * np.sqrt(12)), 0.3 * r),
                  r + 40 * t + 3 * r):
        a = rng.uniform(0.1, 3, 12)
        rows.append(a * scale / np.linalg.norm(a))
    return np.stack(rows)


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("t_over_r", [1e-3, 0.3, 5.0])
@pytest.mark.parametrize("kind", ["ball", "sphere"])
def test_magnitudes_match_nested_root_finding_on_every_branch(name, t_over_r, kind):
    """ball_magnitudes and sphere_magnitudes on a batch of four rows (one per branch: the shrink, a
    row inside the ball, one the sphere's outward step cannot reach, one the ball cannot) against
    :func:`_magnitudes_np`, a where the ball keeps it and the Euclidean a·r/‖a‖ with the flag where
    the step misses the set. Relative error ≤ 1e-13 in float64 and ≤ 2e-6 in float32 (its own input
    rounded; measured: 1.3e-15 and 2.5e-7), the flags exact."""
    mod = importlib.import_module("geomopt.geometry.prox.scalar")
    from geomopt.geometry.reference import make_reference

    ref = REFS[name]
    r = 1.5
    t = t_over_r * r
    a = _rows(t, r)
    want, flags = [], []
    for row in a:
        norm = np.linalg.norm(row)
        inward = norm >= r if kind == "sphere" else True
        reach = (np.sum(np.maximum(row - t, 0) ** 2) <= r * r) if inward else (np.sum((row + t) ** 2) >= r * r)
        if kind == "ball" and norm <= r:
            want.append(row)
        elif not reach:
            want.append(row * r / norm)
        else:
            want.append(_magnitudes_np(row, t, r, ref, outward=not inward))
        flags.append(not reach)
    assert flags == [False, False, kind == "sphere" and t_over_r < 0.1, True]
    solve = mod.ball_magnitudes if kind == "ball" else mod.sphere_magnitudes
    for dtype, rtol in ((torch.float64, 1e-13), (torch.float32, 2e-6)):
        x = torch.tensor(a, dtype=dtype)
        s, bad = solve(x, t, r, make_reference(typed.reference(ref)), dtype)
        assert bad.tolist() == flags, (dtype, bad)
        exact = [(_magnitudes_np(row, t, r, ref, outward=kind == "sphere" and np.linalg.norm(row) < r)
                  if not (f or (kind == "ball" and np.linalg.norm(row) <= r)) else w)
                 for row, w, f in zip(x.double().numpy(), want, flags)] if dtype == torch.float32 else want
        np.testing.assert_allclose(s.double().numpy(), np.stack(exact), rtol=rtol, atol=rtol * 1e-3 * r)
