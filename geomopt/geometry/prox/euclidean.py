"""The euclidean and isotropic rows of the backward table (paper Table 1): X⁺ = P_C(Y), the
Euclidean projection onto every set."""

from __future__ import annotations

from geomopt.support import SPECTRAL_SETS
from geomopt.geometry.matrix import matrices, upcast
from geomopt.geometry.prox.common import _flat, _norm, _per_element, _too_far, _unflat
from geomopt.geometry.prox.spectral_map import _spectral_map
from geomopt.geometry.prox.vector import _VECTOR_PROJ, _sigma_proj
from geomopt.geometry.operators import LOCAL, OWNER, REDUCE, backward_op


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
    kind = constraint["kind"]
    if kind in SPECTRAL_SETS:
        mats = matrices(upcast(y), batch_dims)
        x, _ = _spectral_map(mats, lambda s: (_sigma_proj(kind, s, constraint), None))
        x = _unflat(x, y)
    else:
        x = _unflat(_VECTOR_PROJ[kind](_flat(y, batch_dims), constraint), y)
    if geometry["kind"] == "euclidean" or not ref.bounded:
        return x, None
    diff = _flat(x, batch_dims) - _flat(y, batch_dims)
    scale = _norm(_flat(y, batch_dims))
    return x, _per_element(_too_far(_norm(diff), t, scale, y), y, batch_dims)
