"""Stationarity gap (paper Section 4), Fenchel–Young form:

    gap = ρ·[φ₁*(G) + φ₁(W) − ⟨G, W⟩],   W = (X⁺ − Y)/(γρ) from the backward step, G = ∇f(X⁺).

It is ≥ 0 and vanishes iff G = ∇φ₁(W), i.e. −G = −∇φ₁(W) ∈ ∂g(X⁺): X⁺ is stationary. It needs h and
h*, never h', so it stays finite and accurate for tiny ε.

For numerical nonnegativity the sum is evaluated as a sum of terms that are each ≥ 0 in exact
arithmetic, each clamped at 0: per-coordinate Fenchel–Young terms h(w) + h*(g) − g·w, plus the
Cauchy–Schwarz (isotropic, per row) or von Neumann (spectral) slack ‖G‖‖W‖ − ⟨G, W⟩ resp.
Σσ_i(G)σ_i(W) − tr(GᵀW).

Not available (returns None): the indicator reference (φ₁ = δ, the gap degenerates: use
:func:`dual_norm` where g ≡ 0), Newton–Schulz / Polar Express forwards (they realize a different h
than the declared one), and adam (outside the theory).
"""

from __future__ import annotations

import math

import torch

from geomopt.geometry.reference import Quadratic, Reference, make_reference
from geomopt.geometry.spectral import POLYNOMIAL_APPROXES
from geomopt.geometry.view import reduce, split_view


def stationarity_gap(
    g: torch.Tensor,
    w: torch.Tensor,
    geometry: dict,
    *,
    radius: float | None = None,
    batch_dims: int = 0,
) -> torch.Tensor | None:
    """ρ·[φ₁*(G) + φ₁(W) − ⟨G, W⟩] per batch element (shape ``g.shape[:batch_dims]``), in float32
    (float64 for float64 input); None where the gap is not defined (see module docstring).
    ``radius`` overrides ``geometry["radius"]``. Entries of W outside dom φ₁ (beyond rounding)
    give +∞."""
    kind = geometry["kind"]
    if kind == "adam":
        return None
    approx = (geometry.get("approx") or {}).get("kind")
    if approx in POLYNOMIAL_APPROXES:
        return None
    ref = make_reference(geometry["reference"]) if geometry.get("reference") else Quadratic()
    if ref.kind == "indicator":
        return None
    rho = float(radius if radius is not None else geometry.get("radius", 1.0))
    view, plain = split_view(geometry, g.shape[batch_dims:])
    if view is not None:  # the sum over the view's matrices, each with its own radius ρ·f
        return reduce(g, batch_dims, view,
                      lambda gm, wm, f: stationarity_gap(gm, wm / f, plain, radius=rho * f, batch_dims=1), w)
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    gb = g.to(dtype).reshape(math.prod(g.shape[:batch_dims]), -1)
    wb = w.to(dtype).reshape(gb.shape)
    if kind == "euclidean" or ref.kind == "quadratic" and kind in ("anisotropic", "isotropic"):
        # ½‖W‖² + ½‖G‖² − ⟨G, W⟩ = ½‖W − G‖² for every lifting of the quadratic.
        val = 0.5 * (wb - gb).square().sum(-1)
    elif kind == "anisotropic":
        val = _fy(ref, gb, wb).sum(-1)
    elif kind == "isotropic":
        val = _iso(ref, gb, wb)
    elif kind in ("rowwise", "columnwise"):
        gr, wr = _groups(g.to(dtype), batch_dims, geometry), _groups(w.to(dtype), batch_dims, geometry)
        val = _iso(ref, gr, wr).sum(-1)
    elif kind == "spectral":
        gm, wm = _matrices(g.to(dtype), batch_dims, geometry), _matrices(w.to(dtype), batch_dims, geometry)
        sg, sw = torch.linalg.svdvals(gm), torch.linalg.svdvals(wm)
        per = _fy(ref, sg, sw).sum(-1)
        slack = ((sg * sw).sum(-1) - (gm * wm).sum((-2, -1))).clamp(min=0)  # von Neumann
        val = (per + slack).reshape(gb.shape[0], -1).sum(-1)
    else:
        raise ValueError(f"no stationarity gap for geometry {kind!r}")
    return (rho * val).reshape(g.shape[:batch_dims])


def dual_norm(g: torch.Tensor, geometry: dict, batch_dims: int = 0) -> torch.Tensor:
    """‖G‖_*, the dual of the norm whose unit ball is dom φ₁ (the gap of the lmo method where
    g ≡ 0, per unit radius): nuclear norm for spectral (summed over a ``view``'s matrices, each
    weighted by its radius factor), ℓ1 for anisotropic, Σ of row (column) norms for rowwise
    (columnwise), Frobenius for isotropic, euclidean and adam. Shape ``g.shape[:batch_dims]``."""
    kind = geometry["kind"]
    view, plain = split_view(geometry, g.shape[batch_dims:])
    if view is not None:
        return reduce(g, batch_dims, view, lambda gm, f: f * dual_norm(gm, plain, batch_dims=1))
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    gb = g.to(dtype).reshape(math.prod(g.shape[:batch_dims]), -1)
    if kind == "anisotropic":
        val = gb.abs().sum(-1)
    elif kind == "spectral":
        s = torch.linalg.svdvals(_matrices(g.to(dtype), batch_dims, geometry))
        val = s.sum(-1).reshape(gb.shape[0], -1).sum(-1)
    elif kind in ("rowwise", "columnwise"):
        val = torch.linalg.vector_norm(_groups(g.to(dtype), batch_dims, geometry), dim=-1).sum(-1)
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


def _matrices(x: torch.Tensor, batch_dims: int, geometry: dict) -> torch.Tensor:
    shape = x.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    return x.reshape(-1, m, max(1, math.prod(shape[1:])))


def _groups(x: torch.Tensor, batch_dims: int, geometry: dict) -> torch.Tensor:
    """(B, groups, len): rows for rowwise, columns for columnwise (``layout: in_out`` swaps),
    matching :func:`geomopt.geometry.backward._rows`."""
    shape = x.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    mats = x.reshape(math.prod(x.shape[:batch_dims]), m, -1)
    by_row = (geometry["kind"] == "rowwise") != (geometry.get("layout", "out_in") == "in_out")
    return mats if by_row else mats.transpose(-2, -1)
