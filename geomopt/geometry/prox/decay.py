"""The proximal_decay row of the backward table (every geometry but adam): g = (1/λ)⋆φ, a
rescaling X⁺ = Y/(1 + γλ), elementwise (locality ``LOCAL``)."""

from __future__ import annotations

from geomopt.geometry.matrix import upcast
from geomopt.geometry.operators import backward_op
from geomopt.registry import LOCAL


@backward_op(locality=LOCAL)
def proximal_decay(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """g = (1/λ)⋆φ: X⁺ = Y/(1 + γλ) (paper Remark 2.5; implicit radius ρ/λ). From the optimality
    condition ∇φ(λX) = ∇φ((Y − X)/γ), injectivity of ∇φ gives λX = (Y − X)/γ; it uses γ, not t.
    Defined whenever X ∈ dom g (then λY/(1+γλ) ∈ ρ·dom φ₁ by the triangle inequality), so no flag."""
    return (upcast(y) / (1 + gamma * constraint.lam)).to(y.dtype), None
