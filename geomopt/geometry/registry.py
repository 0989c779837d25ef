"""Registries of operators, filled by decorators in forward.py and backward.py (which pairs a
backward op serves is plain data in :mod:`geomopt.catalog`, readable without torch).

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

from geomopt.catalog import BACKWARD_TABLE, backward_pairs
from geomopt.catalog import supported_constraints as supported_constraints  # re-exported: torch-free

FORWARD_OPS: dict[str, Callable] = {}
BACKWARD_OPS: dict[tuple[str, str], Callable] = {}


def forward_op(geometry: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        FORWARD_OPS[geometry] = fn
        return fn

    return register


def backward_op(fn: Callable, *pairs) -> Callable:
    """Register ``fn`` under the (geometry, constraint) pairs of its row of the backward table,
    :data:`geomopt.catalog.BACKWARD_TABLE` (keyed by the function's name): the table is the one
    place a pair is declared, so lint knows the pairs without importing the ops."""
    if pairs or not callable(fn) or fn.__name__ not in BACKWARD_TABLE:
        name = getattr(fn, "__name__", repr(fn))
        raise TypeError(f"backward op {name!r} has no row in geomopt.catalog.BACKWARD_TABLE: declare the "
                        f"(geometries, constraints) it serves there, then decorate it with a bare @backward_op")
    for pair in backward_pairs(fn.__name__):
        BACKWARD_OPS[pair] = fn
    return fn


def get_backward(geometry: str, constraint: str) -> Callable | None:
    _load()
    return BACKWARD_OPS.get((geometry, constraint))


def get_forward(geometry: str) -> Callable | None:
    _load()
    return FORWARD_OPS.get(geometry)


def _load() -> None:
    # Importing the op modules runs their decorators.
    from geomopt.geometry import backward, forward  # noqa: F401
