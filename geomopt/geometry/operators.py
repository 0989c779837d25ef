"""The forward and backward operators' registries, and where each operator runs (its locality).

The op modules (:mod:`geomopt.geometry.forward`, the rows of :mod:`geomopt.geometry.prox`) import
this module and register into it; ``geomopt.geometry``'s ``__init__`` imports the op modules, so
every operator is registered once the package is imported (this module imports none of them).
Which pairs a backward op serves is plain data in :mod:`geomopt.support`, readable without torch.

Operators are pure functions of tensors and typed config read by attribute: a plan's resolved
geometry (:class:`geomopt.compile.fragments.ResolvedGeometry`, its spec model and concrete view)
and the spec's constraint model (the functional API validates plain dicts into them at its entry).

Forward op:   ``fn(d, geometry: ResolvedGeometry, *, radius: float, batch_dims: int, state: dict | None,
              out_dtype: torch.dtype | None) -> Tensor`` returns ρ·∇φ₁*(d) in out_dtype (None: d's).
              Registered with ``@FORWARD_OPS.register(kind, locality=LOCAL | REDUCE | OWNER,
              forms=(...))``; ``forms`` ``("flat",)``: the map acts entry by entry (or through one
              norm of the whole tensor), so a rule's tensors may step as one flat list
              (:func:`flat_refusal`; on sharded tensors only a ``LOCAL`` one).
Backward op:  ``fn(y, t, ref, constraint: Constraint, *, gamma: float, geometry: ResolvedGeometry, batch_dims: int)
              -> (x, fallback)``, t = γρ; ``fallback`` is a bool tensor of shape
              ``y.shape[:batch_dims]`` (True where the step was undefined and the Euclidean
              projection was used) or None when the op cannot fail. Registered with
              ``@backward_op(locality=...)`` under the pairs of its row of the backward table.

Localities (:data:`geomopt.registry.LOCAL`, ``REDUCE``, ``OWNER``) are read by
the distributed executors through :func:`forward_locality` and :func:`backward_locality`.
"""

from __future__ import annotations

import difflib
from typing import Callable, Union

from geomopt.spec.constraints import CONSTRAINT_KINDS
from geomopt.support import BACKWARD_TABLE, backward_pairs, supported_constraints
from geomopt.registry import LOCAL, LOCALITIES, Registry

__all__ = ["FORWARD_OPS", "BACKWARD_OPS", "backward_op", "get_forward", "get_backward", "forward_locality",
           "backward_locality", "unsupported_message", "elementwise_geometries", "flat_refusal"]

#: A backward op's locality: one of LOCAL / REDUCE / OWNER, or a function of the (geometry,
#: constraint) kinds where it depends on the pair.
Locality = Union[str, Callable[[str, str], str]]

#: geometry kind → forward op; meta ``locality``
FORWARD_OPS = Registry("forward op")
#: (geometry kind, constraint kind) → backward op; meta ``locality`` (a :data:`Locality`)
BACKWARD_OPS = Registry("backward op")


def backward_op(fn: Callable | None = None, *pairs, locality: Locality | None = None):
    """Register a backward op under the (geometry, constraint) pairs of its row of the backward
    table, :data:`geomopt.support.BACKWARD_TABLE` (keyed by the function's name: the table is the
    one place a pair is declared, so lint knows the pairs without importing the ops), with its
    ``locality``. Used as ``@backward_op(locality=REDUCE)``, or ``locality=fn(geometry,
    constraint)`` where the pair decides."""
    if fn is None:
        if pairs or locality is None:
            raise TypeError("decorate a backward op with @backward_op(locality=...) and declare the (geometries, "
                            "constraints) it serves in geomopt.support.BACKWARD_TABLE")
        return lambda f: backward_op(f, locality=locality)
    name = getattr(fn, "__name__", repr(fn))
    if pairs or not callable(fn) or name not in BACKWARD_TABLE:
        raise TypeError(f"backward op {name!r} has no row in geomopt.support.BACKWARD_TABLE: declare the "
                        f"(geometries, constraints) it serves there, then decorate it with @backward_op(locality=...)")
    if not callable(locality) and locality not in LOCALITIES:
        raise TypeError(f"backward op {name!r}: locality must be one of {', '.join(LOCALITIES)} or a function of "
                        f"(geometry, constraint), got {locality!r}")
    for pair in backward_pairs(name):
        BACKWARD_OPS.add(pair, fn, locality=locality)
    return fn


def get_backward(geometry: str, constraint: str) -> Callable | None:
    return BACKWARD_OPS.get((geometry, constraint))


def get_forward(geometry: str) -> Callable | None:
    return FORWARD_OPS.get(geometry)


def elementwise_geometries() -> tuple[str, ...]:
    """The geometries whose forward op declares the flat form (entry by entry, or through one norm
    of the whole tensor)."""
    return tuple(str(k) for k, meta in FORWARD_OPS.meta.items() if "flat" in meta.get("forms", ()))


def flat_refusal(kind: str, sharded: bool = False) -> str | None:
    """Why a rule under geometry ``kind`` cannot step its tensors as one flat list, from its forward
    op's declaration (None: it can): not elementwise, or a norm per tensor that a sharded tensor
    would reduce across ranks."""
    if kind not in elementwise_geometries():
        return f"{kind} geometry is not elementwise"
    if sharded and forward_locality(kind) != LOCAL:
        return f"{kind} geometry is not elementwise on sharded tensors (a norm per tensor)"
    return None


def forward_locality(kind: str, sharded: bool = False) -> str:
    """Locality of the forward op of geometry ``kind`` (KeyError naming the known kinds if none); on
    ``sharded`` tensors, the registration's ``sharded`` locality where it declares one (an op whose
    state lives with the whole matrix: ``LOCAL`` on whole copies, ``OWNER`` on shards)."""
    FORWARD_OPS[kind]  # noqa: B018  (the registry's KeyError for an unknown kind)
    meta = FORWARD_OPS.meta[kind]
    return meta.get("sharded", meta["locality"]) if sharded else meta["locality"]


def backward_locality(geometry: str, constraint: str) -> str:
    """Locality of the backward op registered for (``geometry``, ``constraint``); ValueError (as
    :func:`geomopt.geometry.backward` raises) for a pair with no op."""
    if (geometry, constraint) not in BACKWARD_OPS:
        raise ValueError(unsupported_message(geometry, constraint))
    locality = BACKWARD_OPS.meta[(geometry, constraint)]["locality"]
    return locality(geometry, constraint) if callable(locality) else locality


def unsupported_message(gkind: str, ckind: str) -> str:
    """Why (gkind, ckind) has no backward op, naming the constraints ``gkind`` supports."""
    supported = supported_constraints(gkind)
    if ckind not in CONSTRAINT_KINDS:
        near = difflib.get_close_matches(ckind, CONSTRAINT_KINDS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown constraint {ckind!r}{hint} {gkind} geometry supports: {', '.join(supported) or 'none'}"
    return (
        f"no backward step for constraint {ckind!r} under {gkind!r} geometry; "
        f"{gkind} geometry supports: {', '.join(supported) or 'none (no constraint)'}"
    )
