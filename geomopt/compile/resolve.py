"""What a rule's fragments mean for one tensor: the layout the operators see, the concrete view,
the radius ρ (the geometry's radius times its scale preset for that shape), a ``relative``
constraint radius in units of ρ, and Newton–Schulz's default pre-normalization. One
:func:`resolve` serves the compiler (per rule and shape) and the functional API (per call), so
the two cannot read a spec differently. What it gives is typed and frozen
(:mod:`geomopt.compile.fragments`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from geomopt.compile.fragments import ResolvedGeometry, View
from geomopt.compile.plan import ops_digest
from geomopt.spec.constraints import Constraint
from geomopt.spec.geometries import Geometry, Spectral
from geomopt.spec.model import effective_prenormalize


@dataclasses.dataclass(frozen=True)
class Ops:
    """A tensor's resolved operators: the fragments as the operators take them, ρ, whether they
    act on the transpose (``layout: in_out``), the shape they see, and the digest of it all."""

    geometry: ResolvedGeometry
    constraint: Optional[Constraint]
    radius: float
    transpose: bool
    op_shape: tuple[int, ...]
    digest: str


def geometry_fragment(geometry: Geometry) -> Geometry:
    """A spec geometry with its pre-normalization resolved
    (:func:`geomopt.spec.model.effective_prenormalize`)."""
    if isinstance(geometry, Spectral):
        return geometry.model_copy(update={"prenormalize": effective_prenormalize(geometry)})
    return geometry


def layout(geometry: Geometry, shape: tuple[int, ...], conv1d: bool = False) -> tuple[Geometry, bool, tuple[int, ...]]:
    """(geometry as the ops see it, transpose, op_shape) for a tensor of ``shape``.

    ``layout: in_out`` (and ``auto`` on a Hugging Face ``Conv1D``, ``conv1d``, which stores
    (d_in, d_out)) means the ops act on the transposed tensor, so the geometry they receive says
    ``out_in``; ``auto`` elsewhere is ``out_in``."""
    kind = geometry.get("layout", "out_in")
    if kind == "auto":
        kind = "in_out" if conv1d else "out_in"
    transpose = kind == "in_out" and len(shape) >= 2
    if "layout" in geometry and geometry["layout"] != "out_in":
        geometry = geometry.model_copy(update={"layout": "out_in"})
    shape = tuple(shape)
    return geometry, transpose, ((shape[1], shape[0], *shape[2:]) if transpose else shape)


def op_layout(geometry: Geometry, p) -> tuple[Geometry, bool, tuple[int, ...]]:
    """:func:`layout` for a :class:`~geomopt.compile.match.ParamInfo` (its modules say Conv1D)."""
    return layout(geometry, p.shape, bool(p.modules and "Conv1D" in p.modules))


def resolve_view(geometry: Geometry, op_shape: tuple[int, ...], structure: Optional[dict],
                 constraint: Optional[Constraint] = None) -> Optional[View]:
    """The geometry's spec ``view`` resolved for one tensor (:func:`geomopt.geometry.view.resolve`;
    ``structure`` from the tensor's role), with its block radius factors and whether a
    ``relative`` constraint scales with them; None: the plain matrix. Raises ValueError when the
    view does not fit."""
    spec_view = geometry.get("view")
    if spec_view is None:
        return None
    # geomopt.geometry loads torch: off the lint path
    from geomopt.geometry.scale import block_factors
    from geomopt.geometry.view import resolve as resolve_spec_view

    view = resolve_spec_view(spec_view, op_shape, structure)
    if view is None:
        return None
    if geometry.kind == "kronecker":
        from geomopt.geometry.learned import view_problem

        problem = view_problem(view)
        if problem is not None:
            raise ValueError(problem)
    factors = block_factors(geometry, op_shape, view)
    return dataclasses.replace(view, factors=factors, scale_constraint=bool(
        factors and constraint is not None and constraint.get("relative")))


def resolve(geometry: Geometry, constraint: Optional[Constraint], shape: tuple[int, ...], *,
            conv1d: bool = False, structure: Optional[dict] = None, post: tuple = ()) -> Ops:
    """The operators of a tensor of ``shape`` under a spec ``geometry`` and ``constraint`` (or
    None). Raises ValueError when a view does not fit."""
    from geomopt.geometry.scale import radius_scale  # geomopt.geometry loads torch: off the lint path

    spec, transpose, op_shape = layout(geometry_fragment(geometry), shape, conv1d)
    g = ResolvedGeometry(spec, resolve_view(spec, op_shape, structure, constraint))
    radius = spec.radius * radius_scale(g, op_shape)
    if constraint is not None and constraint.get("relative"):
        # ``relative``: the radius is in units of the geometry's resolved radius ρ
        constraint = constraint.model_copy(update={"radius": constraint["radius"] * radius, "relative": False})
    return Ops(g, constraint, radius, transpose, op_shape, ops_digest(g, constraint, radius, transpose, post))
