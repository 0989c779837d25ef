"""Backward (proximal) steps: X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y), paper eq. (update), Table 1.

With φ = ρ⋆φ₁ the step sees only t = γρ: (γ⋆φ)(Z − Y) = t·φ₁((Z − Y)/t). One small function per
row of the backward table (paper Table 1), registered under the ``(geometry, constraint)`` pairs its
row of :data:`geomopt.support.BACKWARD_TABLE` names; the contract is in :mod:`geomopt.geometry.operators`::

    fn(y, t, ref, constraint: Constraint, *, gamma, geometry: ResolvedGeometry, batch_dims) -> (x, fallback)

The leading ``batch_dims`` dims of ``y`` index independent tensors; every norm, sum and SVD is per
batch element. Spectral ops view an element as a (shape[0], prod(rest)) matrix; a geometry's
``view`` (experts, blocks: :mod:`geomopt.geometry.view`) makes it several matrices, each with its
own constraint, and :func:`backward` hands the op each stack of them.

The rows, one module per family (each registers its functions, with their locality, when
imported; this package imports them in the table's order):

    euclidean      euclidean, isotropic: P_C(Y) onto every set
    anisotropic    separable sets, ℓ2 / Frobenius ball, Frobenius sphere
    spectral       set projections (stiefel, spectral ball / sphere, rank), Frobenius ball / sphere
    groupwise      rowwise, columnwise: Frobenius ball / sphere
    decay          proximal_decay, every geometry but adam

and what they are built from: ``common`` (shared helpers), ``vector`` (Euclidean projections of
vectors and of singular values), ``scalar`` (the τ solves of the ball and sphere steps),
``spectral_map`` (U·Diag(x)·Vᵀ by Gram–eigh or SVD), ``polar`` (SVD-free polar iterations).

Conventions shared by every op (documented once here):

* Numerics: float32 (float64 for float64 input; bfloat16/float16 upcast:
  :func:`geomopt.geometry.matrix.working_dtype`), result in the input dtype. Scalar solves use a
  fixed number of steps (no host syncs): safeguarded Newton for the ball, halvings for the sphere.
* Every projection onto a set is independent of ε: h_ε = ε·h₁ only rescales the objective. The
  scalar solves therefore run with ε = 1 and a dimensionless multiplier τ = tν; only κ matters.
* Feasibility: with a barrier or indicator reference the step is defined only if C meets
  Y + t·dom φ₁ (dom φ₁ = unit ball of ‖·‖∞ for anisotropic, of the spectral norm for spectral, of
  ‖·‖_F for isotropic, of the max row/column norm for rowwise/columnwise). Where it does not, the op
  returns the Euclidean projection P_C(Y) and sets ``fallback``. The test is the closed one with a
  rounding slack of 8u·(scale + t) (u of the *input* dtype): X ∈ C puts Y − X exactly on t·∂dom φ₁
  for the indicator (lmo forward), and for barriers with small ε after rounding, and these steps
  are well defined (as the limit of the barrier solutions).
* Indicator reference (h = δ_[−1,1]): the prox is set-valued (every point of C ∩ (Y + t·dom φ₁)).
  We return the limit κ → ∞ of the power-barrier steps, which is the Euclidean projection of Y onto
  C ∩ (Y + t·dom φ₁): for the ℓ2 ball |x_i| = max(|y_i|/(1+τ), |y_i| − t) (a shrink floored by the
  soft-threshold), for the sphere outward |x_i| = min(|y_i|/(1−τ), |y_i| + t).
* Ties and zeros: sign(0) := +1; top-k keeps the earliest index among equal magnitudes; at Y = 0
  spheres pick (r/√n)·(1, …, 1) (the symmetric point the anisotropic step itself produces) and
  spectral sets pick the "identity" frame U = I[:, :q], V = I[:, :q] (Stiefel: r·I_{m×n}).
"""

from __future__ import annotations

import dataclasses

import torch

# the op modules, in the order of geomopt.support.BACKWARD_TABLE (registration order)
from geomopt.geometry.prox import euclidean, anisotropic, spectral, groupwise, decay  # noqa: F401  isort: skip
from geomopt.geometry.reference import Quadratic, make_reference
from geomopt.geometry.operators import BACKWARD_OPS, unsupported_message
from geomopt.geometry.view import apply as apply_view
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.spec.constraints import Constraint, FrobeniusSphere
from geomopt.spec.geometries import Euclidean

__all__ = ["backward"]


def backward(
    y: torch.Tensor,
    gamma: float | torch.Tensor,
    geometry: ResolvedGeometry,
    constraint: Constraint | None,
    *,
    radius: float | None = None,
    batch_dims: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward step X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y) for one geometry and constraint
    (a plan's resolved geometry and spec constraint, read by attribute). ``radius`` overrides the
    geometry's ``radius`` (ρ); t = γρ.

    A frobenius_sphere with ``method: project`` takes the Euclidean projection r·Y/‖Y‖_F in every
    geometry (hyperball Muon's retraction) instead of the geometry's prox.

    Returns ``(x, fallback)``; ``(y, None)`` without a constraint, and for a zero-size ``y``.
    Raises ValueError for a (geometry, constraint) pair with no operator, naming the constraints
    that geometry supports.
    """
    if constraint is None:
        return y, None
    gkind, ckind = geometry.kind, constraint.kind
    op = BACKWARD_OPS.get((gkind, ckind))
    if op is None:
        raise ValueError(unsupported_message(gkind, ckind))
    rho = float(radius if radius is not None else geometry.radius)
    cfg = geometry.reference
    ref = Quadratic() if cfg is None else make_reference(cfg)
    if isinstance(constraint, FrobeniusSphere) and constraint.method == "project":
        # P_C(Y) whatever the geometry: a retraction, no prox (the euclidean row, on the same view)
        op = BACKWARD_OPS[("euclidean", ckind)]
        geometry = dataclasses.replace(geometry, spec=Euclidean.model_construct(radius=geometry.radius))
    if y.numel() == 0:  # no entries (a dim of size 0): nothing to move, whatever the set
        return y, None
    gamma = gamma if isinstance(gamma, torch.Tensor) else float(gamma)  # a tensor: lr on the device
    view = geometry.view
    if view is None:
        return op(y, gamma * rho, ref, constraint, gamma=gamma, geometry=geometry, batch_dims=batch_dims)
    plain = geometry.matrix
    # a relative radius (the view says so) scales with each block's radius factor
    scaled = view.scale_constraint

    def per_stack(mats, f):
        c = constraint.model_copy(update={"radius": constraint.radius * f}) if scaled and f != 1.0 else constraint
        return op(mats, gamma * rho * f, ref, c, gamma=gamma, geometry=plain, batch_dims=1)

    return apply_view(y, batch_dims, view, per_stack)
