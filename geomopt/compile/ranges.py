"""Ranges: GO126, a step scalar the tensor's floating-point format cannot hold (a blocking error,
registered with :data:`geomopt.compile.blocking.BLOCKING`).

Every step multiplies a tensor by scalars of the spec: γ·ρ (lr times the resolved radius), γ·λ
(lr times weight decay), the square of a constraint's radius (the backward steps compare squared
norms with r²), a polynomial approximation's coefficients. In a
float32 tensor (or bf16/fp16, whose step runs in float32) a scalar beyond float32's largest finite
number, 3.4e38, is no number at all: the step would be ±∞ or NaN, and torch refuses to convert it.
Likewise a polynomial iteration (Newton–Schulz, Polar Express) whose coefficients grow the
pre-normalized singular values (in [0, 1]) past that range within its steps, and, under the
``dual_scale`` post-stage (U ← ⟨U, D⟩·U, which multiplies U's scale in twice), lr·ρ times the
square of the largest singular value the iteration returns.
"""

from __future__ import annotations

import math

from geomopt.compile.match import shape_text
from geomopt.compile.ownership import Ownership
from geomopt.compile.resolve import op_layout
from geomopt.spec.base import field
from geomopt.spec.geometries import Spectral
from geomopt.spec.model import effective_prenormalize, resolve_hyper
from geomopt.support import approx_coefficients

FLOAT32_MAX = 3.4028234663852886e38
FLOAT64_MAX = 1.7976931348623157e308


def _quintic_sup(a: float, b: float, c: float, bound: float) -> float:
    """max |aσ + bσ³ + cσ⁵| over σ ∈ [0, bound]: at ``bound`` or where p' = a + 3bσ² + 5cσ⁴ = 0
    (a quadratic in u = σ²); inf where it overflows a float."""
    candidates = [bound]
    if c != 0:
        disc = 9 * b * b - 20 * a * c
        roots = [(-3 * b + s * math.sqrt(disc)) / (10 * c) for s in (1, -1)] if disc >= 0 else []
    else:
        roots = [-a / (3 * b)] if b != 0 else []
    candidates += [math.sqrt(u) for u in roots if 0 < u < bound * bound]
    best = max(abs(s * (a + s * s * (b + c * s * s))) for s in candidates)
    return best if math.isfinite(best) else math.inf


def iteration_bound(triples: list) -> float:
    """The largest number a quintic iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X forms from singular
    values in [0, 1]: per step, its input bound B gives the terms up to max(1, |b|, |c|)·B⁴ and
    the output bound sup |p| on [0, B] (:func:`_quintic_sup`)."""
    bound, worst = 1.0, 1.0
    for a, b, c in triples:
        worst = max(worst, max(1.0, abs(a), abs(b), abs(c)) * bound ** 4 if bound < 1e77 else math.inf)
        bound = _quintic_sup(a, b, c, bound)
        worst = max(worst, bound)
        if not math.isfinite(worst):
            return math.inf
    return worst


def iteration_output(triples: list) -> float:
    """A bound on the singular values a quintic iteration returns from singular values in [0, 1]:
    each step's sup |p| on its input's bound (:func:`_quintic_sup`)."""
    bound = 1.0
    for a, b, c in triples:
        bound = _quintic_sup(a, b, c, bound)
    return bound


def _scalars(ctx: Ownership, i: int, rho: float):
    """(what, value, spec path) of rule ``i``'s step scalars, with ρ its resolved radius."""
    rule = ctx.spec.rules[i]
    hyper = resolve_hyper(ctx.spec, rule)
    lr, wd = hyper["lr"], hyper["weight_decay"]
    at = ("rules", i, "lr") if rule.lr is not None else ("defaults", "lr") if ctx.spec.defaults.lr is not None \
        else ("rules", i, "geometry")
    by_radius = "radius" in rule.geometry.model_fields_set and rho >= lr
    yield f"lr·radius = {lr:g}·{rho:g}", lr * rho, ("rules", i, "geometry", "radius") if by_radius else at
    yield f"lr·weight_decay = {lr:g}·{wd:g}", lr * wd, at
    c = rule.constraint
    radius = field(c, "radius") if c is not None else None
    if radius is not None:
        r = radius * (rho if field(c, "relative") else 1.0)  # the backward steps compare squared norms with r²
        yield f"the square of the constraint's radius {r:g}", r * r, ("rules", i, "constraint", "radius")
    approx = field(rule.geometry, "approx")
    coefficients = field(approx, "coefficients") if approx is not None else None
    if isinstance(coefficients, list):
        big = max(abs(v) for triple in coefficients for v in triple)
        yield f"a coefficient {big:g}", big, ("rules", i, "geometry", "approx", "coefficients")
    if isinstance(rule.geometry, Spectral) and effective_prenormalize(rule.geometry).kind != "none":
        triples = approx_coefficients(approx.model_dump())
        if triples:
            where = ("rules", i, "geometry", "approx", "coefficients" if field(approx, "coefficients") else "kind")
            yield (f"the {approx.kind} iteration on singular values in [0, 1], which reaches "
                   f"{iteration_bound(triples):g},"), iteration_bound(triples), where
            if any(stage.kind == "dual_scale" for stage in rule.post or ()):
                out = iteration_output(triples)
                yield (f"lr·radius·s² = {lr:g}·{rho:g}·{out:g}², s the largest singular value the "
                       f"{approx.kind} iteration returns, which dual_scale multiplies in twice,"), \
                    lr * rho * out * out, where


def step_overflow(ctx: Ownership):
    """A step scalar beyond the tensor's floating-point range: lr·radius, lr·weight_decay, the
    square of a constraint's radius, a polynomial coefficient, the largest number a polynomial
    iteration forms from pre-normalized singular values, or (with the ``dual_scale`` post-stage)
    lr·radius times the square of the largest singular value it returns, above float32's largest
    number (3.4e38; float64's for float64 tensors). The step would be infinite; torch refuses the
    scalar.

    Bad: ``geometry: {kind: isotropic, reference: {kind: indicator}, radius: 1.0e+308}``.
    Fixed: a radius (and lr) whose product is a number the tensor can hold, e.g. ``radius: 10.0``.
    """
    from geomopt.geometry.scale import radius_scale  # torch, and only with a model: not on the lint path

    for i, rule in enumerate(ctx.spec.rules):
        geometry = rule.geometry
        seen: set = set()
        found = False
        for p in ctx.owned(i):
            if found:
                break
            key = (p.shape, p.dtype, bool(p.modules and "Conv1D" in p.modules))  # what op_layout reads
            if key in seen:
                continue
            seen.add(key)
            op_geometry, _, op_shape = op_layout(geometry, p)
            try:
                rho = field(rule.geometry, "radius", 1.0) * radius_scale(op_geometry, op_shape)
            except (ValueError, ZeroDivisionError):
                continue
            limit, fmt = (FLOAT64_MAX, "float64") if p.dtype == "float64" else (FLOAT32_MAX, "float32")
            for what, value, at in _scalars(ctx, i, rho):
                if abs(value) > limit:
                    yield (f"rule '{rule.name}': {what} is beyond {fmt}'s range ({limit:.3g}) for '{p.name}' "
                           f"({shape_text(p)}, {p.dtype}): its step would be infinite; use smaller values"), at
                    found = True
                    break
