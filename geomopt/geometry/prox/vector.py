"""Euclidean projections of vectors onto the constraint sets, by constraint kind: of a flat
(B, n) batch (:data:`VECTOR_PROJ`, the euclidean and separable rows of the backward table) and of
singular values (:func:`sigma_proj`, the spectral rows: Table 1, second half). Ties and zeros
follow :mod:`geomopt.geometry.prox`'s conventions (sign(0) := +1, the earliest index among equal
magnitudes, (r/√n)·1 for the sphere at 0)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from geomopt.geometry.prox.common import row_norm, sign_plus
from geomopt.spec.constraints import L0, Constraint, ProximalDecay, Rank

def sphere_euclid(a: torch.Tensor, r: float) -> torch.Tensor:
    """Euclidean projection of magnitudes onto the sphere; a = 0 → (r/√n)·1."""
    norm = row_norm(a).unsqueeze(-1)
    n = a.shape[-1]
    return torch.where(norm > 0, a * r / norm.clamp(min=torch.finfo(a.dtype).tiny),
                       torch.full_like(a, r / math.sqrt(n)))


def proj_l2_ball(v: torch.Tensor, r: float) -> torch.Tensor:
    return v * (r / row_norm(v).clamp(min=torch.finfo(v.dtype).tiny)).clamp(max=1).unsqueeze(-1)


def _proj_sphere(v: torch.Tensor, r: float) -> torch.Tensor:
    return sign_plus(v) * sphere_euclid(v.abs(), r)


def _proj_linf_ball(v: torch.Tensor, r: float) -> torch.Tensor:
    return v.clamp(-r, r)


def _proj_linf_sphere(v: torch.Tensor, r: float) -> torch.Tensor:
    """Clip if ‖v‖∞ ≥ r, else move the first max-magnitude entry to sign(v_j)·r (Appendix A.2)."""
    mag = v.abs()
    j = torch.argmax(mag, dim=-1, keepdim=True)  # first index among ties
    lifted = v.scatter(-1, j, sign_plus(v.gather(-1, j)) * r)
    return torch.where(mag.amax(-1, keepdim=True) >= r, v.clamp(-r, r), lifted)


def _proj_sign_set(v: torch.Tensor, r: float) -> torch.Tensor:
    return r * sign_plus(v)


def _keep_top(v: torch.Tensor, k: int) -> torch.Tensor:
    """Zero all but the k largest |v_i|; a stable descending sort keeps the earliest of equals."""
    if k >= v.shape[-1]:
        return v.clone()
    order = torch.sort(v.abs(), dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(v, dtype=torch.bool).scatter(-1, order[..., :k], True)
    return torch.where(keep, v, torch.zeros_like(v))


VECTOR_PROJ: dict[str, Callable] = {
    "l2_ball": lambda v, c: proj_l2_ball(v, c.radius),
    "frobenius_ball": lambda v, c: proj_l2_ball(v, c.radius),
    "frobenius_sphere": lambda v, c: _proj_sphere(v, c.radius),
    "linf_ball": lambda v, c: _proj_linf_ball(v, c.radius),
    "linf_sphere": lambda v, c: _proj_linf_sphere(v, c.radius),
    "sign_set": lambda v, c: _proj_sign_set(v, c.radius),
    "l0": lambda v, c: _keep_top(v, c.k),
}


def _radius(c: Constraint) -> float:
    """The radius r of a set that has one."""
    if isinstance(c, (L0, Rank, ProximalDecay)):
        raise ValueError(f"constraint {c.kind} has no radius")
    return c.radius


def _count(c: Constraint) -> int:
    """The k of a set that keeps k entries (l0) or singular values (rank)."""
    if not isinstance(c, (L0, Rank)):
        raise ValueError(f"constraint {c.kind} has no k")
    return c.k


def sigma_proj(kind: str, s: torch.Tensor, c: Constraint) -> torch.Tensor:
    """Euclidean projections of the singular values (Table 1, second half)."""
    if kind == "stiefel":
        return torch.full_like(s, _radius(c))
    if kind == "spectral_ball":
        return s.clamp(max=_radius(c))
    if kind == "spectral_sphere":
        return _proj_linf_sphere(s, _radius(c))
    if kind == "rank":
        return _keep_top(s, _count(c))  # σ is sorted: keeps σ_1 … σ_k
    if kind in ("frobenius_ball", "l2_ball"):
        return proj_l2_ball(s, _radius(c))
    if kind == "frobenius_sphere":
        return _proj_sphere(s, _radius(c))
    raise KeyError(kind)
