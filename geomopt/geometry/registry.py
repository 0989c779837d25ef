"""Registries of operators, filled by decorators in forward.py and backward.py.

Operators are pure functions of tensors and plain config: spec fragments as plain dicts (the
``model_dump()`` of :mod:`geomopt.spec.model`), never spec objects.

Forward op:   ``fn(d, geometry: dict, *, radius: float, batch_dims: int, state: dict | None,
              out_dtype: torch.dtype | None) -> Tensor`` returns ρ·∇φ₁*(d) in out_dtype (None: d's).
Backward op:  ``fn(y, t, ref, constraint: dict, *, gamma: float, geometry: dict, batch_dims: int)
              -> (x, fallback)``, t = γρ; ``fallback`` is a bool tensor of shape
              ``y.shape[:batch_dims]`` (True where the step was undefined and the Euclidean
              projection was used) or None when the op cannot fail.
"""

from __future__ import annotations

from typing import Callable

FORWARD_OPS: dict[str, Callable] = {}
BACKWARD_OPS: dict[tuple[str, str], Callable] = {}


def forward_op(geometry: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        FORWARD_OPS[geometry] = fn
        return fn

    return register


def backward_op(geometry: str | tuple[str, ...], constraint: str | tuple[str, ...]) -> Callable[[Callable], Callable]:
    geometries = (geometry,) if isinstance(geometry, str) else geometry
    constraints = (constraint,) if isinstance(constraint, str) else constraint

    def register(fn: Callable) -> Callable:
        for g in geometries:
            for c in constraints:
                BACKWARD_OPS[(g, c)] = fn
        return fn

    return register


def supported_constraints(geometry: str) -> list[str]:
    """Constraint kinds with a registered backward op for ``geometry``, in registration order."""
    _load()
    return [c for (g, c) in BACKWARD_OPS if g == geometry]


def get_backward(geometry: str, constraint: str) -> Callable | None:
    _load()
    return BACKWARD_OPS.get((geometry, constraint))


def get_forward(geometry: str) -> Callable | None:
    _load()
    return FORWARD_OPS.get(geometry)


def _load() -> None:
    # Importing the op modules runs their decorators.
    from geomopt.geometry import backward, forward  # noqa: F401
