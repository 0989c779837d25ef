"""The rowwise / columnwise rows of the backward table: the Frobenius ball and sphere under
φ₁ = Σ_j h(‖x_j‖) over the groups x_j (rows or columns: :func:`geomopt.geometry.matrix.groups`).
Each group stays on its ray, so the step is the anisotropic one (:mod:`geomopt.geometry.prox.scalar`)
on the vector of group norms."""

from __future__ import annotations

import torch

from geomopt.geometry.matrix import by_rows, groups, upcast
from geomopt.geometry.prox.common import row_norm, per_element, unflat_rows
from geomopt.geometry.prox.scalar import ball_magnitudes, sphere_magnitudes
from geomopt.geometry.operators import backward_op
from geomopt.registry import REDUCE
from geomopt.compile.fragments import ResolvedGeometry


def _from_rows(rows: torch.Tensor, geometry: ResolvedGeometry, y: torch.Tensor) -> torch.Tensor:
    """The groups (B, groups, len) back in ``y``'s shape and dtype."""
    return unflat_rows(rows if by_rows(geometry) else rows.transpose(-2, -1), y)


@backward_op(locality=REDUCE)
def groupwise_frobenius_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius ball under φ₁ = Σ_j h(‖x_j‖) over rows (columns) x_j. For fixed row norms s_j the
    constraint depends only on s, and ‖x_j − y_j‖ ≥ |s_j − ‖y_j‖| with equality iff x_j ∥ y_j, so
    the prox is x_j = (s_j/‖y_j‖)·y_j with s the anisotropic ℓ2-ball step (Appendix A.1) on the
    vector of row norms a_j = ‖y_j‖. Zero rows stay zero."""
    rows = groups(upcast(y), batch_dims, geometry)
    a = row_norm(rows)
    s, bad = ball_magnitudes(a, t, constraint.radius, ref, y.dtype)
    scale = torch.where(a > 0, s / a.clamp(min=torch.finfo(a.dtype).tiny), torch.zeros_like(a))
    x = _from_rows(rows * scale.unsqueeze(-1), geometry, y)
    return x, None if bad is None else per_element(bad, y, batch_dims)


@backward_op(locality=REDUCE)
def groupwise_frobenius_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius sphere under the row(column)-wise isotropic φ: same reduction as the ball (row
    norms carry the constraint, each row stays on its ray), with the anisotropic sphere step on
    the row norms. A zero row that must grow takes the direction of its first entry
    (deterministic; every direction is optimal)."""
    rows = groups(upcast(y), batch_dims, geometry)
    a = row_norm(rows)
    s, bad = sphere_magnitudes(a, t, constraint.radius, ref, y.dtype)
    e0 = torch.zeros_like(rows)
    e0[..., 0] = 1
    unit = torch.where((a > 0).unsqueeze(-1), rows / a.clamp(min=torch.finfo(a.dtype).tiny).unsqueeze(-1), e0)
    x = _from_rows(unit * s.unsqueeze(-1), geometry, y)
    return x, None if bad is None else per_element(bad, y, batch_dims)
