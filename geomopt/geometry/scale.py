"""Shape-dependent radius presets (geometry field ``scale``) and applicability checks.

The effective radius of a tensor is ``geometry.radius * radius_scale(geometry, shape)``. Shapes
are read through ``layout``: ``out_in`` (torch Linear, Conv: (d_out, d_in, …)) gives
d_out = shape[0], d_in = prod(shape[1:]); ``in_out`` (Hugging Face GPT-2 Conv1D stores
(d_in, d_out); embeddings (vocab, dim) read the same way) gives d_in = shape[0],
d_out = prod(shape[1:]). Under a resolved ``view`` (:mod:`geomopt.geometry.view`) the preset is
computed for the view's first matrix (one expert, one block); other blocks carry their ratio to
it in the view's ``factors``.

Presets:

``none``
    1.
``scion`` — Scion's lmo scalings (Pethick et al. 2025, github.com/LIONS-EPFL/scion, scion.py),
    in the paper's reading ρ = 1/c of g/(c‖g‖ + 1e-8) (paper Remark 2.5):
    spectral: Spectral (normalized=True) ρ = √(d_out/d_in);
    anisotropic: Sign (normalized=True) ρ = 1/d_in;
    rowwise (one vector of length d_in per output unit): RowNorm (normalized=True, its default)
    divides by √d_in·‖row‖, ρ = 1/√d_in;
    columnwise (one vector of length d_out per input unit): ColNorm (normalized=False, its
    default; ColNorm(transpose=True) for embeddings = columnwise with ``layout: in_out``) divides by
    ‖col‖/√d_out, ρ = √d_out (ColNorm(normalized=True), for non-input layers, adds a factor
    1/d_in: put it in ``radius``);
    isotropic: BiasRMS, g/(‖g‖/√n + 1e-8), ρ = √numel.
``muon_original``
    torch.optim.Muon ``adjust_lr_fn="original"``: √max(1, d_out/d_in) (Keller Jordan's Muon).
``match_rms_adamw``
    torch.optim.Muon ``adjust_lr_fn="match_rms_adamw"``: 0.2·√max(d_out, d_in) (Moonshot's
    "Muon is scalable", matching AdamW's update RMS).

torch.optim.Muon reads (A, B) = param.shape[:2] of a Linear weight, i.e. (d_out, d_in) here.
"""

from __future__ import annotations

import math

from typing import Optional, Union

from geomopt.compile.fragments import ResolvedGeometry, View
from geomopt.geometry.view import concrete, matrix_shapes
from geomopt.spec.base import field
from geomopt.spec.geometries import Geometry
from geomopt.support import MATRIX_GEOMETRIES

#: what the presets read: a plan's resolved geometry, or a spec geometry (lint, compile's checks)
AnyGeometry = Union[ResolvedGeometry, Geometry]

SCALE_PRESETS = ("none", "scion", "muon_original", "match_rms_adamw")


def _spec(geometry: AnyGeometry) -> Geometry:
    return geometry.spec if isinstance(geometry, ResolvedGeometry) else geometry


def fan_dims(geometry: AnyGeometry, shape: tuple[int, ...]) -> tuple[int, int]:
    """(d_out, d_in) of one tensor (of the first matrix of its resolved ``view``) as ``layout``
    reads it."""
    shape = tuple(int(s) for s in shape)
    view = concrete(geometry, shape)
    first, rest = matrix_shapes(view, shape)[0]  # no view: the plain (shape[0], rest) matrix
    if view is not None and view.layout == "in_out":  # each matrix stored (in, out)
        first, rest = rest, first
    if field(_spec(geometry), "layout", "out_in") == "in_out":
        return rest, first
    return first, rest


def radius_scale(geometry: AnyGeometry, shape: tuple[int, ...]) -> float:
    """Multiplier of the geometry's ``radius`` for a tensor of ``shape`` (see the module docstring)."""
    preset = field(_spec(geometry), "scale", "none") or "none"
    kind = geometry.kind
    if preset == "none" or kind in ("euclidean", "adam") or 0 in tuple(int(s) for s in shape):
        return 1.0  # a zero-size tensor has no entries to step: its radius is never used
    d_out, d_in = fan_dims(geometry, shape)
    if preset == "muon_original":
        return math.sqrt(max(1.0, d_out / d_in))
    if preset == "match_rms_adamw":
        return 0.2 * math.sqrt(max(d_out, d_in))
    if preset != "scion":
        raise ValueError(f"unknown scale preset {preset!r}; expected one of {', '.join(SCALE_PRESETS)}")
    if kind == "spectral":
        return math.sqrt(d_out / d_in)
    if kind == "anisotropic":
        return 1.0 / d_in
    if kind == "isotropic":
        return math.sqrt(math.prod(int(s) for s in shape))
    if kind == "rowwise":
        return 1.0 / math.sqrt(d_in)
    if kind == "columnwise":
        return math.sqrt(d_out)
    raise ValueError(f"scale preset 'scion' has no rule for geometry {kind!r}")


def block_factors(geometry: Geometry, shape: tuple[int, ...], view: Optional[View]) -> tuple[float, ...] | None:
    """Per block of ``view``, its preset's radius over the first block's (None when all equal)."""
    if view is None or not view.blocks or len(set(view.blocks)) == 1:
        return None
    plain = ResolvedGeometry(geometry)  # one block: the plain matrix
    scales = [radius_scale(plain, (m, n)) for m, n in matrix_shapes(view, shape)]
    factors = tuple(s / scales[0] for s in scales)
    return None if all(f == 1.0 for f in factors) else factors


def check_applicable(geometry: AnyGeometry, shape: tuple[int, ...]) -> str | None:
    """Why ``geometry`` cannot apply to a tensor of ``shape``, or None when it can."""
    kind = geometry.kind
    shape = tuple(int(s) for s in shape)
    if kind in MATRIX_GEOMETRIES and len(shape) < 2:
        return (
            f"{kind} geometry needs a tensor with at least 2 dimensions (viewed as (shape[0], rest)), "
            f"got shape {shape}; use isotropic or anisotropic for {'scalars' if not shape else 'vectors'}"
        )
    return None
