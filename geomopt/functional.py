"""The functional API: the paper's two operators on plain tensors, spec fragments in.

``geometry`` and ``constraint`` are dicts (as in a spec) or spec models; they are validated and
their defaults filled exactly as in a spec file.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
from pydantic import BaseModel, TypeAdapter, ValidationError

from geomopt.compile.resolve import resolve
from geomopt.geometry.forward import forward
from geomopt.geometry.operators import elementwise_geometries
from geomopt.geometry.prox import backward
from geomopt.spec.constraints import Constraint
from geomopt.spec.diagnostics import SpecError, language_diagnostic
from geomopt.spec.geometries import Geometry

_GEOMETRY: TypeAdapter[Geometry] = TypeAdapter(Geometry)
_CONSTRAINT: TypeAdapter[Constraint] = TypeAdapter(Constraint)


def _fragment(adapter: TypeAdapter, value, what: str):
    if isinstance(value, BaseModel):
        value = value.model_dump()
    try:
        model = adapter.validate_python(dict(value))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in (what, *first["loc"]))
        raise SpecError([language_diagnostic("GO005", f"{where}: {first['msg']}", f"<{what}>")]) from None
    except (TypeError, ValueError) as exc:
        raise SpecError([language_diagnostic("GO005", f"{what} must be a mapping with a 'kind': {exc}",
                                             f"<{what}>")]) from None
    return model


def _ops(geometry, constraint, t: torch.Tensor, batch_dims: int):
    """:func:`geomopt.compile.resolve.resolve` for one element of ``t``, as a spec resolves it."""
    c = None if constraint is None else _fragment(_CONSTRAINT, constraint, "constraint")
    return resolve(_fragment(_GEOMETRY, geometry, "geometry"), c, tuple(t.shape[batch_dims:]))


def _transposed(t: torch.Tensor, ops, batch_dims: int) -> torch.Tensor:
    """``t`` as the operators see it (``layout: in_out``: the transpose of each element)."""
    return t.transpose(batch_dims, batch_dims + 1) if ops.transpose else t


def _real_view(t: torch.Tensor, ops, constraint) -> torch.Tensor:
    """``t`` as the operators may read it: a complex tensor's real view (``torch.view_as_real``)
    under an elementwise geometry without constraint; refused elsewhere, as GeomOptimizer
    refuses such a rule (a spectral map of a complex matrix is its complex polar factor U Vᴴ,
    which a map of the real view is not, and casting to real would drop the imaginary part)."""
    if not t.is_complex():
        return t
    kind = ops.geometry.kind
    elementwise = elementwise_geometries()  # entry by entry, or through a norm of all entries:
    # a complex tensor steps as its real view, re and im two real coordinates (as GeomOptimizer does)
    if kind not in elementwise or constraint is not None:
        raise ValueError(f"a complex tensor ({t.dtype}) steps only under an elementwise geometry "
                         f"({', '.join(elementwise)}) with no constraint, as GeomOptimizer's complex parameters: "
                         f"{kind} geometry{' with a constraint' if constraint is not None else ''} acts on it as a "
                         f"matrix or through a set whose complex form is another map. Pass its real view "
                         f"(torch.view_as_real) to step it as a real tensor")
    return torch.view_as_real(t)


def forward_step(d: torch.Tensor, geometry: Union[Mapping, BaseModel], *, batch_dims: int = 0,
                 state: Optional[dict] = None) -> torch.Tensor:
    """∇φ*(D) = ρ·∇φ₁*(D) for ``geometry`` (the forward / preconditioner step); ρ is ``radius``
    times the ``scale`` preset for the shape of one element of ``d``, as in a spec (``layout:
    in_out``: of its transpose, which the operators act on).

    ``batch_dims`` leading dims index independent tensors; ``state`` is needed by ``adam`` only.
    A complex ``d`` steps as its real view under an elementwise geometry and is refused under
    the others (:func:`_real_view`).
    """
    ops = _ops(geometry, None, d, batch_dims)
    x = _real_view(_transposed(d, ops, batch_dims), ops, None)
    out = forward(x, ops.geometry, radius=ops.radius, batch_dims=batch_dims, state=state)
    out = torch.view_as_complex(out) if d.is_complex() else out
    return _transposed(out, ops, batch_dims)


def backward_step(y: torch.Tensor, gamma: float, geometry: Union[Mapping, BaseModel],
                  constraint: Union[Mapping, BaseModel, None], *, batch_dims: int = 0,
                  return_fallback: bool = False):
    """X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y) (the backward / proximal step), t = γρ, ρ resolved as
    in :func:`forward_step` (a ``relative`` constraint radius is in units of it).

    With ``return_fallback`` also returns the flags of tensors where C did not meet
    Y + t·int dom φ₁ and the Euclidean projection was used instead. A complex ``y``: as in
    :func:`forward_step`.
    """
    ops = _ops(geometry, constraint, y, batch_dims)
    y_ops = _real_view(_transposed(y, ops, batch_dims), ops, ops.constraint)
    x, fallback = backward(y_ops, gamma, ops.geometry, ops.constraint, radius=ops.radius,
                           batch_dims=batch_dims)
    x = _transposed(torch.view_as_complex(x) if y.is_complex() else x, ops, batch_dims)
    return (x, fallback) if return_fallback else x
