"""The anisotropic rows of the backward table (paper Table 1, first half), φ₁ = Σh(x_i): the
separable sets (P_C(Y) for every h), the ℓ2 / Frobenius ball and the Frobenius sphere (the scalar
solves of :mod:`geomopt.geometry.prox.scalar` on |Y|)."""

from __future__ import annotations

import torch

from geomopt.geometry.prox.common import flat_rows, per_element, sign_plus, too_far, unflat_rows
from geomopt.geometry.prox.scalar import ball_magnitudes, sphere_magnitudes
from geomopt.geometry.prox.vector import VECTOR_PROJ
from geomopt.geometry.operators import backward_op
from geomopt.registry import LOCAL, OWNER, REDUCE


def _separable_locality(geometry: str, constraint: str) -> str:
    """l0 (top-k) and linf_sphere (the first argmax) need the whole tensor; sign_set and linf_ball
    are elementwise."""
    return OWNER if constraint in ("l0", "linf_sphere") else LOCAL


@backward_op(locality=_separable_locality)
def anisotropic_separable(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Sets whose anisotropic prox is P_C(Y) for every even h increasing in |u| (paper Table 1):
    sign_set(r) → r·sign(Y) (sign(0) := +1); linf_ball(r) → clip(Y, −r, r); linf_sphere(r) → clip
    if ‖Y‖∞ ≥ r, else the first max-magnitude entry moves to sign(y_j)·r (Appendix A.2);
    l0(k) → keep the k largest |y_i| (H_k; earliest index among ties). Each coordinate moves as
    little as the set allows, which also minimizes ‖X − Y‖∞: infeasible where that exceeds t."""
    v = flat_rows(y, batch_dims)
    x = VECTOR_PROJ[constraint.kind](v, constraint)
    if not ref.bounded:
        return unflat_rows(x, y), None
    bad = too_far((x - v).abs().amax(-1), t, v.abs().amax(-1), y)
    return unflat_rows(x, y), per_element(bad, y, batch_dims)


@backward_op(locality=REDUCE)
def anisotropic_l2_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """ℓ2 (Frobenius) ball under φ₁ = Σh(x_i) (paper Appendix A.1): Y if ‖Y‖ ≤ r, else
    x_i = sign(y_i)·s_i with s_i + t(h*)'(ν s_i) = |y_i| and ν ≥ 0 found by bisection so that
    ‖x‖ = r. Log barrier: closed-form root; power barrier: safeguarded Newton; indicator: the κ → ∞
    limit s_i = max(|y_i|/(1+τ), |y_i| − t); quadratic: the Euclidean projection."""
    v = flat_rows(y, batch_dims)
    s, bad = ball_magnitudes(v.abs(), t, constraint.radius, ref, y.dtype)
    x = unflat_rows(torch.sign(v) * s, y)
    return x, None if bad is None else per_element(bad, y, batch_dims)


@backward_op(locality=REDUCE)
def anisotropic_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius (ℓ2) sphere under φ₁ = Σh(x_i) (paper Theorem 3.5 with Appendix A.1): the ball step if ‖Y‖ ≥ r, else
    the outward step sign(x_i) = sign(y_i), |x_i| = s_i ≥ |y_i| with s_i − t(h*)'(ν s_i) = |y_i|
    (log barrier: νs² + (1 − νt − νa)s − a = 0; a = 0: s = max(0, t − 1/ν)), ν by bisection.
    Feasible iff Σ(|y_i| + t)² ≥ r²; at Y = 0 the result is (r/√n)·1."""
    v = flat_rows(y, batch_dims)
    s, bad = sphere_magnitudes(v.abs(), t, constraint.radius, ref, y.dtype)
    x = unflat_rows(sign_plus(v) * s, y)
    return x, None if bad is None else per_element(bad, y, batch_dims)
