"""The spectral rows of the backward table (paper Table 1, second half), φ₁ = Σh(σ_i): the set
projections (stiefel, spectral ball and sphere, rank: P_C(Y) for every h, exact or by the polar
iterations) and the Frobenius ball and sphere (the scalar solves on σ(Y), Theorem 3.5). Every
step is a matrix function: locality ``OWNER``."""

from __future__ import annotations

from geomopt.geometry import method as method_choice
from geomopt.geometry.matrix import matrices, upcast
from geomopt.geometry.prox.common import per_element, too_far, unflat_rows
from geomopt.geometry.prox.polar import POLAR
from geomopt.geometry.prox.scalar import ball_magnitudes, sphere_magnitudes
from geomopt.geometry.prox.spectral_map import spectral_apply
from geomopt.geometry.prox.vector import sigma_proj
from geomopt.geometry.spectral import apply_approx
from geomopt.geometry.operators import backward_op
from geomopt.registry import OWNER


@backward_op(locality=OWNER)
def spectral_projection(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Orthogonally invariant sets whose spectral prox is P_C(Y) for every h (Theorem 3.5 reduces
    to the separable step on σ(Y), whose solution is h-independent; Table 1):
    stiefel(r) → r·U Vᵀ (reduced SVD, wide or tall; zero σ use LAPACK's completions; Y = 0 →
    r·I_{m×n}); spectral_ball(r) → U·Diag(min(σ_i, r))·Vᵀ; spectral_sphere(r) → the linf_sphere
    step on σ (Appendix A.2); rank(k) → U·Diag(H_k(σ))·Vᵀ. ``method: polar`` (stiefel,
    spectral_ball) is SVD-free and approximate: :func:`~geomopt.geometry.prox.polar._stiefel_polar`,
    :func:`~geomopt.geometry.prox.polar._spectral_ball_polar`;
    ``auto`` picks one by device and size (:func:`geomopt.geometry.method.resolve_method`).
    Infeasible where max_i |x_i − σ_i| > t (the spectral distance from Y to C). ``method: msign``
    (stiefel) is :func:`_msign_retraction`, no projection."""
    kind = constraint.kind
    method = method_choice.resolve_method(constraint, y.device, y.shape[batch_dims:])
    if method == "msign":
        return _msign_retraction(y, ref, constraint, geometry, batch_dims), None
    if method == "polar":
        return POLAR[kind](y, t, ref, constraint, geometry=geometry, batch_dims=batch_dims)

    def step(s):
        sx = sigma_proj(kind, s, constraint)
        return sx, too_far((sx - s).abs().amax(-1), t, s.amax(-1), y) if ref.bounded else None

    x, bad = spectral_apply(matrices(upcast(y), batch_dims), step)
    return unflat_rows(x, y), None if bad is None else per_element(bad, y, batch_dims)


def _msign_retraction(y, ref, constraint, geometry, batch_dims):
    """X⁺ = r·msign(Y) with msign the rule's own spectral approximation (``approx`` and
    ``prenormalize`` of the geometry, as the forward step runs them): SPEL's retraction onto the
    Stiefel manifold, x_{t+1} = msign(x_t − α·msign(∇f)) (Manifold Constrained Steepest Descent,
    arXiv:2601.21487; NVIDIA Emerging-Optimizers' ``Spel``). With Muon's quintic the singular values
    end near r (in about [0.7r, 1.2r]), not on it: a retraction, not the projection, and no
    feasibility test."""
    x = apply_approx(matrices(upcast(y), batch_dims), ref, geometry.approx, geometry.prenormalize,
                     scale=float(constraint.radius), out_dtype=upcast(y).dtype)
    return unflat_rows(x, y)


@backward_op(locality=OWNER)
def spectral_frobenius_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius ball under φ₁ = Σh(σ_i) (Theorem 3.5 with Appendix A.1): the anisotropic ℓ2-ball
    step on σ(Y), then X⁺ = U·Diag(x)·Vᵀ."""
    x, bad = spectral_apply(matrices(upcast(y), batch_dims),
                           lambda s: ball_magnitudes(s, t, constraint.radius, ref, y.dtype))
    return unflat_rows(x, y), None if bad is None else per_element(bad, y, batch_dims)


@backward_op(locality=OWNER)
def spectral_frobenius_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius sphere under φ₁ = Σh(σ_i) (Theorem 3.5): the anisotropic sphere step on σ(Y)
    (outward steps may lift zero singular values: LAPACK's completions give their vectors), then
    U·Diag(x)·Vᵀ. Y = 0 → (r/√q)·I_{m×n}."""
    x, bad = spectral_apply(matrices(upcast(y), batch_dims),
                           lambda s: sphere_magnitudes(s, t, constraint.radius, ref, y.dtype))
    return unflat_rows(x, y), None if bad is None else per_element(bad, y, batch_dims)
