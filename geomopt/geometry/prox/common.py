"""Helpers every backward step shares: the flat (B, n) reading of a batch in the working dtype and
back, per-element flags, the rounding-aware feasibility test, sign and norm conventions
(:mod:`geomopt.geometry.prox`: conventions)."""

from __future__ import annotations

import torch

from geomopt.geometry.matrix import upcast, vectors
from geomopt.geometry.reference import Reference


def flat_rows(y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """(B, n) in the working dtype, B = prod(batch shape) (1 when batch_dims = 0)."""
    return vectors(upcast(y), batch_dims)


def unflat_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x`` back in ``y``'s shape and dtype."""
    return x.reshape(y.shape).to(y.dtype)


def per_element(flag: torch.Tensor, y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """Flags per row of the flat or matrix reading, (B,), → per element (batch shape)."""
    return flag.reshape(y.shape[:batch_dims])


def rounding_slack(scale: torch.Tensor, t: float, dtype: torch.dtype) -> torch.Tensor:
    """Rounding slack for the feasibility test: Y = X − t·W carries errors of u·(|X| + t)."""
    return 8 * torch.finfo(dtype).eps * (scale + t)


def too_far(dist: torch.Tensor, t: float, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """True where dist(Y, C) in the geometry's norm exceeds t (beyond rounding)."""
    return dist > t + rounding_slack(scale, t, y.dtype)


def sign_plus(y: torch.Tensor) -> torch.Tensor:
    """sign with sign(0) := +1 (deterministic point for zero entries)."""
    return torch.where(y < 0, -torch.ones_like(y), torch.ones_like(y))


def row_norm(v: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(v, dim=-1)


def ref_profile(ref: Reference) -> str:
    if ref.kind in ("quadratic", "log_barrier", "indicator", "power_barrier"):
        return ref.kind
    raise ValueError(f"backward steps do not know reference {ref.kind!r}")
