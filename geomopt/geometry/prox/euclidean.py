"""The euclidean and isotropic rows of the backward table (paper Table 1): X⁺ = P_C(Y), the
Euclidean projection onto every set."""

from __future__ import annotations

from geomopt.support import SPECTRAL_SETS
from geomopt.geometry.matrix import matrices, upcast
from geomopt.geometry.prox.common import flat_rows, row_norm, per_element, too_far, unflat_rows
from geomopt.geometry.prox.spectral_map import spectral_apply
from geomopt.geometry.prox.vector import VECTOR_PROJ, sigma_proj
from geomopt.geometry.operators import backward_op
from geomopt.registry import LOCAL, OWNER, REDUCE


def _projection_locality(geometry: str, constraint: str) -> str:
    """Spectral sets (an SVD), l0 (top-k) and linf_sphere (the first argmax) need the whole tensor;
    linf_ball and sign_set are elementwise under the euclidean geometry, while the isotropic one
    adds a feasibility norm, as do the ℓ2 / Frobenius balls and spheres."""
    if constraint in SPECTRAL_SETS or constraint in ("l0", "linf_sphere"):
        return OWNER
    if constraint in ("linf_ball", "sign_set") and geometry == "euclidean":
        return LOCAL
    return REDUCE


@backward_op(locality=_projection_locality)
def euclidean_projection(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """X⁺ = P_C(Y), the Euclidean projection (paper Example 2.6: an isotropic φ = h∘‖·‖ is an
    increasing function of the distance, so the prox of an indicator is P_C; for euclidean φ it
    is the definition). Spectral sets act on the (shape[0], rest) matrix (per matrix of a
    ``view``). Isotropic: infeasible where ‖P_C(Y) − Y‖_F > t (C misses Y + t·dom φ₁); then P_C(Y) is
    also the fallback, so only the flag differs."""
    kind = constraint.kind
    if kind in SPECTRAL_SETS:
        mats = matrices(upcast(y), batch_dims)
        x, _ = spectral_apply(mats, lambda s: (sigma_proj(kind, s, constraint), None))
        x = unflat_rows(x, y)
    else:
        x = unflat_rows(VECTOR_PROJ[kind](flat_rows(y, batch_dims), constraint), y)
    if geometry.kind == "euclidean" or not ref.bounded:
        return x, None
    diff = flat_rows(x, batch_dims) - flat_rows(y, batch_dims)
    scale = row_norm(flat_rows(y, batch_dims))
    return x, per_element(too_far(row_norm(diff), t, scale, y), y, batch_dims)
