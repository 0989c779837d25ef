"""Minimized cases the pipeline fuzzer found (tests/test_fuzz_pipeline.py), one test each, checked
against what the step must give rather than only against not raising."""

from __future__ import annotations

import torch
from torch import nn

import geomopt


def _stepped(spec_text: str, param: torch.Tensor, steps: int = 2, fmt: str = "dsl", seed: int = 0):
    """(parameter after the optimizer is built, after ``steps`` steps with random gradients)."""
    model = nn.Module()
    model.w = nn.Parameter(param.clone())
    opt = geomopt.GeomOptimizer([("w", model.w)], geomopt.parse_spec(spec_text, fmt))
    start = model.w.detach().clone()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.w.grad = torch.randn(model.w.shape, generator=g)
        opt.step()
    return start, model.w.detach()


def test_tiny_step_on_a_sphere_is_the_projection():
    """lr 1e-300: the prox's (r/t)² overflowed a Python float (OverflowError), and a/t made the
    solve NaN. As t → 0 the step is the Euclidean projection of Y ≈ X: X stays where it is."""
    for constraint in ("frobenius_sphere(relative=true)", "frobenius_ball(radius=0.5)"):
        for ref in ("power_barrier(kappa=4.0, eps=0.002)", "log_barrier(eps=1e-8)", "indicator"):
            spec = f"""geomopt 1
name "tiny"
defaults lr=1e-300
rule all match "**":
    geometry spectral({ref}, approx=svd)
    constraint {constraint}
"""
            start, end = _stepped(spec, torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
            assert torch.isfinite(end).all(), (constraint, ref)
            torch.testing.assert_close(end, start, rtol=1e-6, atol=1e-7)
