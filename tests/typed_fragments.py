"""Spec fragments written in the tests as plain dicts, turned into the typed objects the arithmetic
units of geomopt.geometry take: each validated through the spec's own pydantic model (as
geomopt.functional does at its entry), a geometry wrapped with its concrete view. Nothing else
changes: no scale preset, layout or pre-normalization is resolved (geomopt.compile.resolve does
that for a plan), so a test reads the operators as it wrote them."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pydantic import TypeAdapter

from geomopt.compile.fragments import ResolvedGeometry, View
from geomopt.geometry import gap
from geomopt.geometry.forward import forward as forward_op
from geomopt.geometry.prox import backward as backward_op
from geomopt.geometry.view import resolve
from geomopt.spec.constraints import Constraint
from geomopt.spec.geometries import Approx, Geometry, Prenormalize, Reference
from geomopt.spec.geometries import View as SpecView

_GEOMETRY: TypeAdapter[Geometry] = TypeAdapter(Geometry)
_CONSTRAINT: TypeAdapter[Constraint] = TypeAdapter(Constraint)
_REFERENCE: TypeAdapter[Reference] = TypeAdapter(Reference)
_APPROX: TypeAdapter[Approx] = TypeAdapter(Approx)
_PRENORM: TypeAdapter[Prenormalize] = TypeAdapter(Prenormalize)
_VIEW: TypeAdapter[SpecView] = TypeAdapter(SpecView)

_NO_REFERENCE = ("euclidean", "adam", "kronecker")
_RESOLVED_VIEW = {"batch", "trailing", "blocks", "factors", "layout", "scale_constraint"}


def _model(adapter: TypeAdapter, value: Any) -> Any:
    return adapter.validate_python(dict(value)) if isinstance(value, Mapping) else value


def geometry(value: Any, shape: Optional[tuple] = None) -> ResolvedGeometry:
    """A geometry dict (or spec model) as a resolved geometry: a spec ``view`` resolved for an
    element of ``shape`` (needed then), an already resolved view dict (``batch``, ``trailing``,
    ``blocks``, …) taken as it is."""
    if isinstance(value, ResolvedGeometry):
        return value
    if not isinstance(value, Mapping):
        value = value.model_dump()
    value = dict(value)
    view = value.get("view")
    concrete: Optional[View] = None
    if isinstance(view, Mapping) and "kind" not in view and set(view) <= _RESOLVED_VIEW:
        del value["view"]
        blocks, factors = view.get("blocks"), view.get("factors")
        concrete = View(view["batch"], view["trailing"], None if blocks is None else tuple(blocks),
                        None if factors is None else tuple(factors), view.get("layout"),
                        view.get("scale_constraint", False))
    elif view is not None:
        if shape is None:
            raise ValueError("a spec view needs the element's shape to resolve")
        concrete = resolve(_model(_VIEW, view), tuple(shape))
    return ResolvedGeometry(_GEOMETRY.validate_python(value), concrete)


def preset_geometry(value: Any) -> Any:
    """A geometry dict as the spec's model (its spec view resolved by the callee, as the lint's
    shapes are) for the scale presets and the applicability checks, which never read the reference:
    the quadratic one filled in where a kind needs one and the dict names none."""
    if isinstance(value, Mapping) and "reference" not in value and value.get("kind") not in _NO_REFERENCE:
        value = {**value, "reference": {"kind": "quadratic"}}
    return _model(_GEOMETRY, value)


def view(value: Any) -> Any:
    """A spec view dict (``{"kind": "matrix", "blocks": 3}``) as the spec's model."""
    return _model(_VIEW, value)


def constraint(value: Any) -> Any:
    """A constraint dict as the spec's model (None stays None)."""
    return None if value is None else _model(_CONSTRAINT, value)


def reference(value: Any) -> Any:
    """A reference dict (``{"kind": "power_barrier", "kappa": 4}``) as the spec's model."""
    return _model(_REFERENCE, value)


def approx(value: Any) -> Any:
    """An approx dict as the spec's model (None stays None)."""
    return None if value is None else _model(_APPROX, value)


def prenorm(value: Any) -> Any:
    """A pre-normalization dict as the spec's model (None stays None)."""
    return None if value is None else _model(_PRENORM, value)


def forward(d, geo: Any, **kw):
    """geomopt.geometry.forward on a geometry written as a dict (a spec view resolved for ``d``'s
    elements, after ``batch_dims``)."""
    return forward_op(d, geometry(geo, tuple(d.shape[kw.get("batch_dims", 0):])), **kw)


def backward(y, gamma, geo: Any, con: Any, **kw):
    """geomopt.geometry.backward on fragments written as dicts."""
    return backward_op(y, gamma, geometry(geo, tuple(y.shape[kw.get("batch_dims", 0):])), constraint(con), **kw)


def stationarity_gap(g, w, geo: Any, *, constraint: Any = None, **kw):
    """geomopt.geometry.gap.stationarity_gap on fragments written as dicts."""
    return gap.stationarity_gap(g, w, geometry(geo, tuple(g.shape[kw.get("batch_dims", 0):])),
                                constraint=_constraint(constraint), **kw)


def dual_norm(g, geo: Any, batch_dims: int = 0):
    """geomopt.geometry.gap.dual_norm on a geometry written as a dict."""
    return gap.dual_norm(g, geometry(geo, tuple(g.shape[batch_dims:])), batch_dims)


def gap_reference(geo: Any, con: Any = None, reference: str = "auto") -> Optional[dict]:
    """geomopt.geometry.gap.gap_reference on fragments written as dicts, the reference as a dict."""
    ref = gap.gap_reference(geometry(geo), _constraint(con), reference)
    return None if ref is None else ref.model_dump()


def gap_unavailable(geo: Any, con: Any = None, reference: str = "auto") -> Optional[str]:
    """geomopt.geometry.gap.gap_unavailable on fragments written as dicts."""
    return gap.gap_unavailable(geometry(geo), _constraint(con), reference)


_constraint = constraint
