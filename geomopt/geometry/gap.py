"""Stationarity gap (paper Section 4), Fenchel–Young form:

    gap = ρ·[φ₁*(Ĝ) + φ₁(W) − ⟨Ĝ, W⟩],   W = (X⁺ − Y)/(γρ) from the backward step, G = ∇f(X⁺),

Ĝ = G, or G pre-normalized per matrix as the forward step normalizes its input (Scale, below). It
is ≥ 0 and needs h and h*, never h', so it stays finite and accurate for tiny ε.

What a zero certifies. The backward step X⁺ ∈ argmin_Z g(Z) + t·φ₁((Z − Y)/t) has the optimality
condition −∇φ₁(W) ∈ ∂g(X⁺) *for the reference φ₁ it was computed with*, and by Fenchel–Young
gap = 0 iff Ĝ = ∇φ₁(W); then −Ĝ = −∇φ₁(W) ∈ ∂g(X⁺) and X⁺ is stationary (the paper's
D_{φ*}(∇f, −∇̃g) with the subgradient the step picked). Conversely, at a fixed point of an exact
forward step W = ∇φ₁*(Ĝ) and the gap is 0. So φ₁ must be a reference the backward step is a
prox for:

* the declared reference, always: every backward step uses it (:mod:`geomopt.geometry.prox`),
  whatever approximation the forward step runs. The realized κ = 4 barrier of a Newton–Schulz /
  Polar Express forward (:func:`geomopt.support.realized_reference`) reaches the
  backward step only through the declaration: measured against it while the backward step used
  another h, a zero (Ĝ = ∇φ_realized(W)) would not make −Ĝ a subgradient of g;
* any reference, where the backward step does not depend on h (spectral set projections:
  spectral_ball, spectral_sphere, stiefel, rank, paper Table 1; no constraint). There the one the
  forward realizes is the right one: the gap then vanishes at the iteration's fixed points as far
  as the forward is ∇φ₁*(Ĝ).

``reference="auto"`` (the default) is that rule: the realized barrier for a Newton–Schulz / Polar
Express rule whose backward step is independent of h, the declared reference otherwise (the
shipped specs declare the realized barrier, ε to a few %, so the two differ little there; where
the declared one is the indicator, "auto" still measures such a rule). ``"declared"`` and
``"realized"`` force one; ``"realized"`` under an h-dependent step (Frobenius ball, sphere) measures
the distance to the iteration's own fixed point, not stationarity. Either way the gap is computed
exactly (singular values by SVD), never with the polynomial iteration.

Scale. With ``prenormalize`` (on by default for Newton–Schulz / Polar Express) the forward step
sees D̂ = D/(‖D‖_F + ε) per matrix, so at a fixed point W = ∇φ₁*(Ĝ), and pairing W with G would
leave D_{φ₁*}(G, Ĝ) > 0 at stationary points (negligible where σ(G) ≫ ε, of order ρε per direction
for small gradients). For a set constraint ∂g(X⁺) is a cone, −Ĝ ∈ ∂g(X⁺) iff −G ∈ ∂g(X⁺), and W
is paired with Ĝ. ``proximal_decay`` (g = (1/λ)⋆φ) is no cone: W is paired with G (the normalized
iteration's fixed points are not stationary for f + g then, and the gap says so).

The floor of a polynomial iteration. The composed odd polynomial p of Newton–Schulz / Polar
Express is no ∇φ₁* (it oscillates around 1: for σ̂ ≥ 2e-3 Muon's 5-step map lies between 0.68 and
1.2, Polar Express's between 0.87 and 1.13), so at its fixed points the gap is its model error
ρ·Σᵢ [h*(σ̂ᵢ) + h(p(σ̂ᵢ)) − σ̂ᵢ·p(σ̂ᵢ)] over the active directions, not 0; and +∞ once p(σ̂ᵢ) > 1
puts W outside dom φ₁ (the backward step counts such steps as fallbacks).

For numerical nonnegativity the sum is evaluated as a sum of terms that are each ≥ 0 in exact
arithmetic, each clamped at 0: per-coordinate Fenchel–Young terms h(w) + h*(g) − g·w, plus the
Cauchy–Schwarz (isotropic, per row) or von Neumann (spectral) slack ‖G‖‖W‖ − ⟨G, W⟩ resp.
Σσ_i(G)σ_i(W) − tr(GᵀW).

Not available (None; :func:`gap_unavailable` says why): adam (no reference function), a
constraint whose step is a retraction (``method: msign`` or ``project``: no prox, no pair to
measure), and the indicator reference (φ₁* = ‖·‖_* is not strictly convex: the Fenchel–Young term vanishes for every
Ĝ in the normal cone at W, so a zero certifies nothing; use :func:`dual_norm` where g ≡ 0).
"""

from __future__ import annotations

import math

import torch
from pydantic import TypeAdapter

from geomopt.support import SPECTRAL_SETS, realized_reference
from geomopt.geometry.matrix import groups, matrices, vectors, working_dtype
from geomopt.geometry.reference import Reference, make_reference
from geomopt.geometry.prenorm import default_prenormalize, prenormalize
from geomopt.geometry.view import reduce
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.spec.constraints import Constraint, FrobeniusSphere, Stiefel
from geomopt.spec.geometries import GramNewtonSchulz, NewtonSchulz, PolarExpress, Prenormalize, Quadratic
from geomopt.spec.geometries import Reference as ReferenceSpec

_REFERENCE: TypeAdapter[ReferenceSpec] = TypeAdapter(ReferenceSpec)
_POLYNOMIAL = (NewtonSchulz, GramNewtonSchulz, PolarExpress)
_QUADRATIC = Quadratic()  # the reference of the geometries that declare none (euclidean)

#: values of the ``reference`` argument (module docstring)
GAP_REFERENCES = ("auto", "declared", "realized")


def gap_reference(geometry: ResolvedGeometry, constraint: Constraint | None = None,
                  reference: str = "auto") -> ReferenceSpec | None:
    """The reference the gap of a (geometry, constraint) pair is measured against (module
    docstring): the declared one, or for a Newton–Schulz / Polar Express forward the realized
    κ = 4 barrier where ``reference`` is ``"realized"``, or ``"auto"`` and the backward step does
    not depend on h. None for adam. ``constraint`` None means g ≡ 0."""
    if reference not in GAP_REFERENCES:
        raise ValueError(f"unknown gap reference {reference!r}; expected one of {', '.join(GAP_REFERENCES)}")
    if geometry.kind == "adam":
        return None
    declared = geometry.reference or _QUADRATIC
    approx = geometry.approx
    realized = realized_reference(approx.model_dump()) if isinstance(approx, _POLYNOMIAL) else None
    if realized is None or reference == "declared":
        return declared
    if reference == "realized" or _any_reference(geometry, constraint):
        return _REFERENCE.validate_python(realized)
    return declared


def gap_unavailable(geometry: ResolvedGeometry, constraint: Constraint | None = None,
                    reference: str = "auto") -> str | None:
    """Why :func:`stationarity_gap` is None for this (geometry, constraint) pair, and what to look
    at instead; None where it is defined."""
    if isinstance(constraint, (Stiefel, FrobeniusSphere)) and _retraction(constraint):
        return (f"the {constraint.kind} step is a retraction (method {constraint.method}), not the geometry's "
                "prox: there is no Fenchel–Young pair (G, W) to measure; watch the loss and update_norm")
    ref = gap_reference(geometry, constraint, reference)
    if ref is None:
        return ("adam is outside the theory: its step is not ∇φ₁* of a reference function, so there is no "
                "Fenchel–Young pair (G, W) to measure; watch the loss and update_norm")
    if ref.kind != "indicator":
        return None
    why = ("the indicator reference has φ₁* = ‖·‖_*, not strictly convex: φ₁*(G) − ⟨G, W⟩ vanishes for "
           "every G in the normal cone at W, so a zero would not certify stationarity")
    approx = geometry.approx_kind
    if isinstance(geometry.approx, _POLYNOMIAL) and _any_reference(geometry, constraint):
        return why + (f"; reference 'auto' measures the {approx} forward's realized κ = 4 barrier, which "
                      "certifies here (the backward step does not depend on h)")
    return why + ("; declare a barrier (power_barrier or log_barrier, small eps: the same steps as eps → 0) "
                  "to measure a gap")


def stationarity_gap(
    g: torch.Tensor,
    w: torch.Tensor,
    geometry: ResolvedGeometry,
    *,
    constraint: Constraint | None = None,
    reference: str = "auto",
    radius: float | None = None,
    batch_dims: int = 0,
) -> torch.Tensor | None:
    """ρ·[φ₁*(Ĝ) + φ₁(W) − ⟨Ĝ, W⟩] per batch element (shape ``g.shape[:batch_dims]``), in float32
    (float64 for float64 input); None where the gap is not defined (:func:`gap_unavailable`).
    φ₁ is :func:`gap_reference`'s; Ĝ is G pre-normalized per matrix as the geometry's forward step
    normalizes its input, except under ``proximal_decay`` (module docstring). ``constraint``: the
    rule's (None: g ≡ 0); ``radius`` overrides the geometry's ``radius``. Entries of W outside dom φ₁
    (beyond rounding) give +∞."""
    cfg = gap_reference(geometry, constraint, reference)
    if cfg is None or cfg.kind == "indicator" or _retraction(constraint):
        return None
    rho = float(radius if radius is not None else geometry.radius)
    return _gap(g, w, geometry, make_reference(cfg),
                _gap_prenormalize(geometry, constraint), rho, batch_dims)


def _retraction(constraint: Constraint | None) -> bool:
    """Whether the constraint's step is a retraction, not a prox (stiefel msign, frobenius_sphere project)."""
    return isinstance(constraint, (Stiefel, FrobeniusSphere)) and constraint.method in ("msign", "project")


def _any_reference(geometry: ResolvedGeometry, constraint: Constraint | None) -> bool:
    """Whether the backward step is the prox for every reference: no constraint, or a spectral set
    projection (paper Table 1; :func:`geomopt.geometry.prox.spectral.spectral_projection`)."""
    return constraint is None or geometry.kind == "spectral" and constraint.kind in SPECTRAL_SETS


def _gap_prenormalize(geometry: ResolvedGeometry, constraint: Constraint | None) -> Prenormalize | None:
    """The pre-normalization the gap applies to G (a :func:`prenormalize` cfg), or None."""
    if geometry.kind != "spectral" or constraint is not None and constraint.kind == "proximal_decay":
        return None
    cfg = geometry.prenormalize
    if cfg is None:
        cfg = default_prenormalize(geometry.approx_kind or "svd")
    return None if cfg.kind == "none" else cfg


def _gap(g: torch.Tensor, w: torch.Tensor, geometry: ResolvedGeometry, ref: Reference, prenorm: Prenormalize | None,
         rho: float, batch_dims: int) -> torch.Tensor:
    kind = geometry.kind
    view, plain = geometry.view, geometry.matrix
    if view is not None:  # the sum over the view's matrices, each with its own radius ρ·f
        return reduce(g, batch_dims, view, lambda gm, wm, f: _gap(gm, wm / f, plain, ref, prenorm, rho * f, 1), w)
    dtype = working_dtype(g.dtype)
    gb = vectors(g.to(dtype), batch_dims)
    wb = w.to(dtype).reshape(gb.shape)
    if kind == "euclidean" or ref.kind == "quadratic" and kind in ("anisotropic", "isotropic"):
        # ½‖W‖² + ½‖G‖² − ⟨G, W⟩ = ½‖W − G‖² for every lifting of the quadratic.
        val = 0.5 * (wb - gb).square().sum(-1)
    elif kind == "anisotropic":
        val = _fy(ref, gb, wb).sum(-1)
    elif kind == "isotropic":
        val = _iso(ref, gb, wb)
    elif kind in ("rowwise", "columnwise"):
        gr, wr = groups(g.to(dtype), batch_dims, geometry), groups(w.to(dtype), batch_dims, geometry)
        val = _iso(ref, gr, wr).sum(-1)
    elif kind == "spectral":
        gm, wm = matrices(g.to(dtype), batch_dims), matrices(w.to(dtype), batch_dims)
        if prenorm is not None:  # per matrix, as the forward step's approximations do
            gm = prenormalize(gm, prenorm)
        sg, sw = torch.linalg.svdvals(gm), torch.linalg.svdvals(wm)
        per = _fy(ref, sg, sw).sum(-1)
        slack = ((sg * sw).sum(-1) - (gm * wm).sum((-2, -1))).clamp(min=0)  # von Neumann
        val = (per + slack).reshape(gb.shape[0], -1).sum(-1)
    else:
        raise ValueError(f"no stationarity gap for geometry {kind!r}")
    return (rho * val).reshape(g.shape[:batch_dims])


def dual_norm(g: torch.Tensor, geometry: ResolvedGeometry, batch_dims: int = 0) -> torch.Tensor:
    """‖G‖_*, the dual of the norm whose unit ball is dom φ₁ (the gap of the lmo method where
    g ≡ 0, per unit radius): nuclear norm for spectral (summed over a ``view``'s matrices, each
    weighted by its radius factor), ℓ1 for anisotropic, Σ of row (column) norms for rowwise
    (columnwise), Frobenius for isotropic, euclidean and adam. Shape ``g.shape[:batch_dims]``."""
    kind = geometry.kind
    view, plain = geometry.view, geometry.matrix
    if view is not None:
        return reduce(g, batch_dims, view, lambda gm, f: f * dual_norm(gm, plain, batch_dims=1))
    dtype = working_dtype(g.dtype)
    gb = vectors(g.to(dtype), batch_dims)
    if kind == "anisotropic":
        val = gb.abs().sum(-1)
    elif kind == "spectral":
        s = torch.linalg.svdvals(matrices(g.to(dtype), batch_dims))
        val = s.sum(-1).reshape(gb.shape[0], -1).sum(-1)
    elif kind in ("rowwise", "columnwise"):
        val = torch.linalg.vector_norm(groups(g.to(dtype), batch_dims, geometry), dim=-1).sum(-1)
    else:
        val = torch.linalg.vector_norm(gb, dim=-1)
    return val.reshape(g.shape[:batch_dims])


# ---------------------------------------------------------------- helpers


def _fy(ref: Reference, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-coordinate Fenchel–Young terms h(w) + h*(g) − g·w ≥ 0 (clamped: rounding)."""
    return (_h(ref, w) + ref.conj(g) - g * w).clamp(min=0)


def _h(ref: Reference, w: torch.Tensor) -> torch.Tensor:
    """h(w), with |w| a few ulps past 1 pulled back inside: W = (X⁺ − Y)/t rounds onto the
    boundary when the barrier step saturates (small ε); beyond rounding it is +∞."""
    if not ref.bounded:
        return ref.h(w)
    a = w.abs()
    eps = torch.finfo(w.dtype).eps
    inside = torch.minimum(a, torch.full_like(a, 1 - eps))
    val = ref.h(inside)
    return torch.where(a > 1 + 8 * eps, torch.full_like(val, math.inf), val)


def _iso(ref: Reference, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h(‖W‖) + h*(‖G‖) − ⟨G, W⟩ over the last dim, as FY(‖G‖, ‖W‖) + Cauchy–Schwarz slack."""
    ng, nw = torch.linalg.vector_norm(g, dim=-1), torch.linalg.vector_norm(w, dim=-1)
    slack = (ng * nw - (g * w).sum(-1)).clamp(min=0)
    return _fy(ref, ng, nw) + slack
