"""Scalar reference functions h (unit radius, domain |x| < 1 except quadratic), paper Section 2.

Each class gives h, h', (h*)', h* and the isotropic factor (h*)'(s)/s, elementwise on tensors.
A φ is built from h by :mod:`geomopt.geometry.forward` (separable, isotropic, spectral).
Construct from a spec fragment with :func:`make_reference`.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

REFERENCES: dict[str, type] = {}


def reference(kind: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        cls.kind = kind
        REFERENCES[kind] = cls
        return cls

    return register


def make_reference(cfg: Mapping) -> "Reference":
    """``{"kind": "power_barrier", "kappa": 4, "eps": 1e-3}`` → a :class:`PowerBarrier`."""
    params = {k: v for k, v in dict(cfg).items() if k != "kind"}
    return REFERENCES[cfg["kind"]](**params)


class Reference:
    """h with its derivatives; ``kappa`` is None for the quadratic, ∞ for the indicator."""

    kind: str = ""
    eps: float = 0.0
    kappa: float | None = None
    bounded = True  # dom h = [−1, 1] (barriers, indicator) rather than ℝ

    def h(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dh(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dual_grad(self, y: torch.Tensor) -> torch.Tensor:
        """(h*)'(y)."""
        raise NotImplementedError

    def iso_factor(self, s: torch.Tensor) -> torch.Tensor:
        """(h*)'(s)/s for s ≥ 0, evaluated without forming y/|y| (finite at s = 0)."""
        raise NotImplementedError

    def conj(self, y: torch.Tensor) -> torch.Tensor:
        """h*(y)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eps={self.eps}, kappa={self.kappa})"


@reference("log_barrier")
class LogBarrier(Reference):
    """h(x) = −ε(ln(1−|x|)+|x|), h'(x) = εx/(1−|x|), (h*)'(y) = y/(ε+|y|),
    h*(y) = |y| − ε·ln(1+|y|/ε) (DESIGN's table; paper Example 2.6)."""

    kappa = 1.0

    def __init__(self, eps: float = 1e-8):
        self.eps = float(eps)

    def h(self, x):
        a = x.abs()
        return -self.eps * (torch.log1p(-a) + a)

    def dh(self, x):
        return self.eps * x / (1 - x.abs())

    def dual_grad(self, y):
        return y / (self.eps + y.abs())

    def iso_factor(self, s):
        return 1 / (self.eps + s)

    def conj(self, y):
        a = y.abs()
        return a - self.eps * torch.log1p(a / self.eps)


@reference("power_barrier")
class PowerBarrier(Reference):
    """h'(x) = εx/(1−|x|^κ)^{1/κ}, (h*)'(y) = y/(ε^κ+|y|^κ)^{1/κ},
    h(x) = ε(x²/2)·₂F₁(2/κ,1/κ;1+2/κ;|x|^κ), h*(y) = ∫₀^{|y|} s(ε^κ+s^κ)^{−1/κ} ds
    (κ = 2: h = ε(1−√(1−x²)), h* = √(ε²+y²)−ε). κ = 4 models Newton–Schulz / Polar Express
    (paper Appendix F, Theorem 4.7)."""

    def __init__(self, kappa: float = 4.0, eps: float = 1e-3):
        self.kappa = float(kappa)
        self.eps = float(eps)

    def dh(self, x):
        k = self.kappa
        # 1 − |x|^κ = −expm1(κ·log|x|) keeps digits near the boundary.
        return self.eps * x / (-torch.expm1(k * torch.log(x.abs()))).pow(1 / k)

    def dual_grad(self, y):
        return y * self.iso_factor(y.abs())

    def iso_factor(self, s):
        k, e = self.kappa, self.eps
        # (ε^κ + s^κ)^{−1/κ} = 1/(m·(1 + (min/max)^κ)^{1/κ}) with m = max(ε, s): no overflow.
        m = torch.clamp(s, min=e)
        r = torch.minimum(s, torch.full_like(s, e)) / m
        return 1 / (m * (1 + r.pow(k)).pow(1 / k))

    def h(self, x):
        return _power_barrier_h(x, self.kappa, self.eps)

    def conj(self, y):
        return _power_barrier_conj(y, self.kappa, self.eps)


@reference("indicator")
class Indicator(Reference):
    """h = δ_[−1,1] (the ε→0 limit of either barrier): (h*)'(y) = sign(y) (0 at 0), h*(y) = |y|.
    ∇φ* is then the lmo (Muon, Scion); the Fenchel–Young gap is not available."""

    kappa = math.inf

    def h(self, x):
        return torch.where(x.abs() <= 1, torch.zeros_like(x), torch.full_like(x, math.inf))

    def dh(self, x):
        return torch.zeros_like(x)

    def dual_grad(self, y):
        return torch.sign(y)

    def iso_factor(self, s):
        return torch.where(s > 0, 1 / s, torch.zeros_like(s))

    def conj(self, y):
        return y.abs()


@reference("quadratic")
class Quadratic(Reference):
    """h(x) = x²/2 = h*(x): the Euclidean reference, (h*)' = identity."""

    kappa = None
    eps = 1.0
    bounded = False

    def h(self, x):
        return 0.5 * x * x

    dh = staticmethod(lambda x: x)
    dual_grad = staticmethod(lambda y: y)

    def iso_factor(self, s):
        return torch.ones_like(s)

    def conj(self, y):
        return 0.5 * y * y


def _power_barrier_h(x: torch.Tensor, kappa: float, eps: float) -> torch.Tensor:
    raise NotImplementedError("power_barrier h: see geomopt.geometry.reference")


def _power_barrier_conj(y: torch.Tensor, kappa: float, eps: float) -> torch.Tensor:
    raise NotImplementedError("power_barrier h*: see geomopt.geometry.reference")
