"""The Polar Express figure example (paper Appendix F): the claim it illustrates, and the PNG."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from geomopt.geometry.polynomial import compose_polynomials
from geomopt.support import polar_express_coefficients

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plot_preconditioners.py"


@pytest.fixture(scope="module")
def pp():
    spec = importlib.util.spec_from_file_location("plot_preconditioners", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def rows(pp):
    return {c: {r.steps: r for r in pp.summary(coefficients=c)} for c in ("polar_express", "speedrun")}


def test_pe_map_is_the_composed_quintic(pp):
    """Independent scalar check: iterate x ← ax + bx³ + cx⁵ by hand."""
    sigma = torch.tensor([1e-4, 3e-3, 0.2, 1.0], dtype=torch.float64)
    x = sigma.clone()
    for a, b, c in polar_express_coefficients(5):
        x = a * x + b * x**3 + c * x**5
    torch.testing.assert_close(pp.pe_map(sigma, 5), x, rtol=1e-13, atol=0)


def test_h4_dual_grad_formula(pp):
    sigma = torch.tensor([0.0, 1e-5, 1e-3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(pp.h4_dual_grad(sigma, 1e-3), sigma / (1e-12 + sigma**4) ** 0.25, rtol=1e-14, atol=0)


def test_l2_distance_against_closed_form(pp):
    sigma = pp.grid()
    # ∫₀¹ (σ − σ²)² dσ = 1/30
    assert pp.l2_distance(sigma, sigma**2, sigma) == pytest.approx(math.sqrt(1 / 30), rel=1e-6)


@pytest.mark.parametrize("coefficients", ["polar_express", "speedrun"])
@pytest.mark.parametrize("steps", [5, 6, 7, 8])
def test_pe_closer_to_h4_at_best_eps_than_to_sign(rows, coefficients, steps):
    """The paper's claim (Appendix F): holds for both lists at 5–8 steps (see the module docstring)."""
    r = rows[coefficients][steps]
    assert r.l2_best < r.l2_sign
    # the fit is a minimum: no panel ε does better
    assert all(r.l2_best <= d + 1e-12 for d in r.l2_h4.values())


def test_margins_as_documented(rows):
    pe = rows["polar_express"]
    assert pe[5].l2_sign - pe[5].l2_best < 0.1 * pe[5].l2_sign  # small at 5 steps (oscillation dominates)
    assert pe[6].l2_best < 0.1 * pe[6].l2_sign  # an order of magnitude from 6 steps on
    assert pe[7].l2_h4[1e-3] > pe[7].l2_sign  # a mismatched ε loses to sign


@pytest.mark.parametrize("steps,design_eps", [(5, 1.05e-3), (6, 5.8e-4), (7, 3.2e-4)])
def test_best_fit_eps_near_design_and_slope_model(rows, steps, design_eps):
    r = rows["polar_express"][steps]
    assert r.best_eps == pytest.approx(design_eps, rel=0.15)
    assert r.best_eps == pytest.approx(r.slope_eps, rel=0.15)
    # the fitted curve really is close where it matters, near 0: slope 1/ε vs ∏aᵢ
    x = torch.tensor([1e-9], dtype=torch.float64)
    slope = (compose_polynomials(polar_express_coefficients(steps), x) / x).item()
    assert 1 / slope == pytest.approx(r.slope_eps, rel=1e-9)


def test_main_writes_png(pp, tmp_path, capsys):
    pp.main(["--out", str(tmp_path / "sub")])
    assert (tmp_path / "sub" / "preconditioners.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "best eps" in text and all(f"\n{s:>5}" in text for s in (5, 6, 7, 8))
