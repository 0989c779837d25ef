"""geometry/prox/scalar.py: the steps on magnitudes (the ℓ2-ball and sphere solves, the box
thresholds, the scalar duals' Newton iterations) against nested scipy root-finding and closed forms
in float64."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import scipy.optimize as so
import torch

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
    s, bad = mod.ball_magnitudes(torch.tensor(a)[None], t, r, make_reference(ref), torch.float64)
    assert not bool(bad[0])
    np.testing.assert_allclose(s[0].numpy(), t * sigma(np.exp(log_tau)), rtol=1e-12, atol=1e-14 * r)
