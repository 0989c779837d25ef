"""The functional API: the paper's two operators on plain tensors, spec fragments in.

``geometry`` and ``constraint`` are dicts (as in a spec) or spec models; they are validated and
their defaults filled exactly as in a spec file.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
from pydantic import BaseModel, TypeAdapter, ValidationError

from geomopt.spec.diagnostics import SpecError, language_diagnostic
from geomopt.spec.model import Constraint, Geometry, Spectral, effective_prenormalize

_GEOMETRY = TypeAdapter(Geometry)
_CONSTRAINT = TypeAdapter(Constraint)


def _fragment(adapter: TypeAdapter, value, what: str):
    if isinstance(value, BaseModel):
        value = value.model_dump()
    try:
        model = adapter.validate_python(dict(value))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SpecError([language_diagnostic("GO005", f"{what}.{where}: {first['msg']}", f"<{what}>")]) from None
    except (TypeError, ValueError) as exc:
        raise SpecError([language_diagnostic("GO005", f"{what} must be a mapping with a 'kind': {exc}", f"<{what}>")]) from None
    return model


def geometry_dict(geometry: Union[Mapping, BaseModel]) -> dict:
    """Validated geometry fragment as the operators take it (prenormalize resolved)."""
    g = _fragment(_GEOMETRY, geometry, "geometry")
    out = g.model_dump()
    if isinstance(g, Spectral):
        out["prenormalize"] = effective_prenormalize(g).model_dump()
    if "layout" in out:
        out["layout"] = "out_in" if out["layout"] == "auto" else out["layout"]
    return out


def _radius(g: dict, t: torch.Tensor, batch_dims: int) -> float:
    """ρ as a spec resolves it for one tensor: ``radius`` times the ``scale`` preset of its shape."""
    from geomopt.geometry.scale import radius_scale

    return float(g["radius"]) * radius_scale(g, tuple(t.shape[batch_dims:]))


def forward_step(d: torch.Tensor, geometry: Union[Mapping, BaseModel], *, batch_dims: int = 0,
                 state: Optional[dict] = None) -> torch.Tensor:
    """∇φ*(D) = ρ·∇φ₁*(D) for ``geometry`` (the forward / preconditioner step); ρ is ``radius``
    times the ``scale`` preset for the shape of one element of ``d``, as in a spec.

    ``batch_dims`` leading dims index independent tensors; ``state`` is needed by ``adam`` only.
    """
    from geomopt.geometry.forward import forward

    g = geometry_dict(geometry)
    return forward(d, g, radius=_radius(g, d, batch_dims), batch_dims=batch_dims, state=state)


def backward_step(y: torch.Tensor, gamma: float, geometry: Union[Mapping, BaseModel],
                  constraint: Union[Mapping, BaseModel, None], *, batch_dims: int = 0,
                  return_fallback: bool = False):
    """X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y) (the backward / proximal step), t = γρ, ρ resolved as
    in :func:`forward_step` (a ``relative`` constraint radius is in units of it).

    With ``return_fallback`` also returns the flags of tensors where C did not meet
    Y + t·int dom φ₁ and the Euclidean projection was used instead.
    """
    from geomopt.geometry.backward import backward

    g = geometry_dict(geometry)
    rho = _radius(g, y, batch_dims)
    c = None if constraint is None else _fragment(_CONSTRAINT, constraint, "constraint").model_dump()
    if c is not None and c.get("relative"):  # radius in units of the geometry's ρ (scale preset included)
        c.update(radius=c["radius"] * rho, relative=False)
    x, fallback = backward(y, gamma, g, c, radius=rho, batch_dims=batch_dims)
    return (x, fallback) if return_fallback else x
