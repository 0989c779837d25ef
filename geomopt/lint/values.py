"""Values and combinations that are legal but suspect: GO106 numerically dubious values (a tiny
ε, a scale preset that makes updates vanish), GO107 a spectral approximation that realizes another
reference than the declared one under an h-dependent constraint, GO108 decoupled decay that leaves
a sphere or Stiefel set, GO109 choices outside the paper's theory (a note), GO121 a post-stage that
undoes the geometry, GO122 cautious masking or decay under a whole-update prox, GO128 an int8
momentum under a spectral map (a note). None needs a model (GO106's scale check uses one where
given).
"""

from __future__ import annotations

import math

from geomopt.support import realized_reference
from geomopt.compile.match import shape_text
from geomopt.compile.resolve import op_layout
from geomopt.lint.context import LintContext, lint_rule
from geomopt.spec.base import field


def _eps_paths(rule, i):
    g = rule.geometry
    ref = field(g, "reference")
    if ref is not None and field(ref, "eps") is not None:
        yield ref.eps, ("rules", i, "geometry", "reference", "eps")
    pre = field(g, "prenormalize")
    if pre is not None and field(pre, "eps") is not None:
        yield pre.eps, ("rules", i, "geometry", "prenormalize", "eps")
    if g.kind == "adam":
        yield g.eps, ("rules", i, "geometry", "eps")


@lint_rule("GO106", "dubious-value", "warning")
def dubious_value(ctx: LintContext):
    """Values that are legal but numerically dubious: an ε below 1e-12, or a scale preset that shrinks a radius below
    1e-4 of its value.

    Such an ε is below float32 resolution of the quantities it guards, so it guards nothing; a radius scaled that
    small makes the updates vanish (e.g. ``scale: scion`` on a sign geometry of a 50k-wide embedding).

    Bad: ``reference: {kind: log_barrier, eps: 1.0e-20}``. Fixed: ``eps: 1.0e-8``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        for eps, path in _eps_paths(rule, i):
            if eps < 1e-12:
                yield f"eps={eps:g} is below 1e-12: float32 cannot resolve it; use ≥ 1e-12 (1e-8 is usual)", path
        owned = ctx.owned(i)
        scale = field(rule.geometry, "scale", "none")  # euclidean and adam have no scale
        if owned and scale != "none":
            from geomopt.geometry.scale import radius_scale  # torch: only with a model

            for p in owned:
                op_geometry, _, op_shape = op_layout(rule.geometry, p)  # the shape the compiled plan scales by
                try:
                    s = radius_scale(op_geometry, op_shape)
                except (ValueError, ZeroDivisionError):
                    continue
                if s < 1e-4:
                    yield (f"scale={scale} multiplies the radius by {s:.2g} for '{p.name}' "
                           f"({shape_text(p)}): its updates nearly vanish"), ("rules", i, "geometry", "scale")
                    break


_H_DEPENDENT = {"l2_ball", "frobenius_ball", "frobenius_sphere"}


@lint_rule("GO107", "reference-approx-mismatch", "warning")
def reference_approx_mismatch(ctx: LintContext):
    """Newton–Schulz and Polar Express realize the spectral power barrier κ = 4 with ε ≈ 1/∏aᵢ
    (paper Appendix F, Theorem 4.7), not the declared reference. Under a constraint whose backward
    step depends on h (ℓ2 / Frobenius ball and sphere) the declared reference is what the step uses,
    so a mismatch makes forward and backward disagree. A ``frobenius_sphere`` with ``method: project`` is
    the Euclidean projection, which no reference enters: not flagged.

    Bad: ``reference: {kind: log_barrier}`` with ``approx: {kind: polar_express, steps: 5}`` and
    ``constraint: {kind: frobenius_ball}``. Fixed:
    ``reference: {kind: power_barrier, kappa: 4, eps: 1.05e-3}`` (what PE-5 realizes), or ``approx: {kind: svd}``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        g = rule.geometry
        if (g.kind != "spectral" or rule.constraint is None or rule.constraint.kind not in _H_DEPENDENT
                or field(rule.constraint, "method") == "project"):  # the Euclidean projection: h plays no part
            continue
        realized = realized_reference(g.approx.model_dump())
        if realized is None:
            continue
        ref = g.reference
        ok = (ref.kind == "power_barrier" and abs(ref.kappa - realized["kappa"]) < 1e-9
              and abs(math.log(ref.eps / realized["eps"])) < math.log(2))
        if not ok:
            steps = field(g.approx, "steps")  # realized is None for svd and gram_eigh, which have no steps
            yield (f"rule '{rule.name}': {g.approx.kind}({steps} steps) realizes power_barrier(kappa=4, "
                   f"eps≈{realized['eps']:.3g}) but the {rule.constraint.kind} step uses the declared {ref.kind}; "
                   f"declare the realized reference or use approx svd"), ("rules", i, "geometry", "reference")


_SET_SHRUNK = {"frobenius_sphere", "stiefel", "sign_set", "spectral_sphere", "linf_sphere"}


@lint_rule("GO108", "decay-leaves-set", "warning")
def decay_leaves_set(ctx: LintContext):
    """Decoupled weight decay (X ← X(1 − lr·wd)) under a sphere, Stiefel or sign constraint.

    The decay shrinks X off the set before every step; the backward step then starts from an infeasible point.

    Bad: ``weight_decay: 0.1`` with ``constraint: {kind: stiefel}``. Fixed: drop the decay (the set
    already bounds the weights) or use a ball.
    """
    for i, rule in enumerate(ctx.spec.rules):
        wd = rule.weight_decay if rule.weight_decay is not None else ctx.spec.defaults.weight_decay
        if wd and rule.constraint is not None and rule.constraint.kind in _SET_SHRUNK:
            yield (f"rule '{rule.name}': weight_decay={wd:g} shrinks X out of the {rule.constraint.kind} "
                   f"each step; remove it"), ("rules", i, "constraint", "kind")


def _sign_like(rule) -> bool:
    ref = field(rule.geometry, "reference")
    return rule.geometry.kind == "anisotropic" and ref is not None and ref.kind == "indicator"


@lint_rule("GO121", "stage-undoes-geometry", "warning")
def stage_undoes_geometry(ctx: LintContext):
    """A post-stage that undoes what the geometry did: an elementwise second moment after a sign geometry, or after the
    adam geometry.

    Every entry of sign(D) has magnitude 1, so the running mean of U² tends to 1 and the stage only adds lag; after
    adam the update is normalized twice.

    Bad: ``geometry: {kind: anisotropic, reference: {kind: indicator}}`` with
    ``post: [{kind: second_moment, axis: element}]``. Fixed: drop the stage, or normalize a spectral or
    Euclidean update instead.
    """
    for i, rule in enumerate(ctx.spec.rules):
        for j, stage in enumerate(rule.post or ()):
            if (stage.kind == "second_moment" and stage.axis == "element"
                    and (_sign_like(rule) or rule.geometry.kind == "adam")):
                what = ("a sign geometry's entries all have magnitude 1" if _sign_like(rule)
                        else "adam already divides by √v")
                yield (f"rule '{rule.name}': second_moment(axis=element) after the {rule.geometry.kind} geometry: "
                       f"{what}, so the stage undoes nothing useful; drop it"), ("rules", i, "post", j, "kind")


#: constraints whose backward step acts entry by entry (a masked update is still theirs to project)
_ELEMENTWISE_SETS = ("proximal_decay", "linf_ball", "sign_set")


@lint_rule("GO122", "cautious-under-constraint", "warning")
def cautious_under_constraint(ctx: LintContext):
    """Cautious masking (``post: [cautious]``) or cautious weight decay under a constraint whose backward step is a
    prox of the whole update (balls, spheres, Stiefel, rank).

    The prox is defined for the geometry's step Y = X − γρ∇φ*(D); a masked step or a partial decay is no longer
    that, so the step leaves the method the constraint was chosen for.

    Bad: ``post: [{kind: cautious}]`` with ``constraint: {kind: spectral_ball}``. Fixed: drop the
    masking, or drop the constraint (cautious Muon is unconstrained).
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.constraint is None or rule.constraint.kind in _ELEMENTWISE_SETS:
            continue
        for j, stage in enumerate(rule.post or ()):
            if stage.kind == "cautious":
                yield (f"rule '{rule.name}': cautious masking under the {rule.constraint.kind} constraint, whose prox "
                       f"needs the full update; drop one of them"), ("rules", i, "post", j, "kind")
        decay = rule.decay if rule.decay is not None else ctx.spec.defaults.decay
        if decay is not None and decay.kind == "cautious":
            at = ("rules", i, "decay") if rule.decay is not None else ("defaults", "decay")
            yield (f"rule '{rule.name}': cautious weight decay under the {rule.constraint.kind} constraint, whose prox "
                   f"needs the full update; use decoupled decay or drop the decay"), at


@lint_rule("GO109", "outside-theory", "note")
def outside_theory(ctx: LintContext):
    """Choices the paper's convergence theory does not cover: the ``adam`` and ``kronecker`` geometries, and any
    constraint with the ``indicator`` reference.

    The convergence guarantees do not apply there: ``adam`` is an escape hatch for hybrids, ``kronecker`` learns
    its metric from the data (the theory's φ is fixed), and with the
    ``indicator`` reference (lmo / Frank–Wolfe steps) the Fenchel–Young stationarity gap is not available. It is
    a note: fine where chosen on purpose (embeddings in a hybrid).

    Example: ``geometry: {kind: adam}`` (noted; fine for embeddings in a hybrid). Inside the theory:
    ``geometry: {kind: spectral, reference: {kind: power_barrier, kappa: 4, eps: 1.0e-3}}`` with
    ``constraint: {kind: frobenius_ball}``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        g = rule.geometry
        if g.kind in ("adam", "kronecker"):
            yield (f"rule '{rule.name}': the {g.kind} geometry is outside the paper's theory"
                   + (" (its metric is learned from the data)" if g.kind == "kronecker" else ""),
                   ("rules", i, "geometry", "kind"))
        ref = field(g, "reference")
        if rule.constraint is not None and ref is not None and ref.kind == "indicator":
            yield (f"rule '{rule.name}': {rule.constraint.kind} with the indicator reference is outside the "
                   f"theory (no stationarity gap)"), ("rules", i, "geometry", "reference")


@lint_rule("GO128", "quantized-spectral-momentum", "note")
def int8_spectral_momentum(ctx: LintContext):
    """A spectral rule whose momentum is kept in ``int8``.

    Block-wise 8-bit rounding adds noise of about 1% of the momentum's norm in every direction at once. A spectral
    map (Newton–Schulz, Polar Express, SVD, a power barrier) takes every singular value above a small threshold to
    about one: where the float32 momentum is low-rank, that noise lands in directions it leaves near zero and is
    lifted into the update (``benchmarks/state_update_error.py`` measures it rule by rule; the demo's hidden
    momentum is spread and loses nothing, char_gpt's Frobenius-proximal one is a third near-null and loses more). It
    is a note: int8 is fine where the momentum is spread. ``int8-ec`` on this rule keeps each code's rounding in
    4 bits beside it, a tenth of int8's error (char_gpt's hidden update moves 0.053 of its norm, int8's 0.481,
    bfloat16's 0.091) at 0.38 of float32's bytes; ``bfloat16`` (0.5) does too; either keeps the rest in int8.

    Example: ``defaults: {state: int8}`` over a ``geometry: {kind: spectral, …}`` rule with momentum. Kept in
    int8 elsewhere: that rule with ``state: int8-ec``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        state = rule.state if rule.state is not None else ctx.spec.defaults.state
        direction = rule.direction if rule.direction is not None else ctx.spec.defaults.direction
        if rule.geometry.kind != "spectral" or state is None or state.dtype != "int8":
            continue
        if direction is not None and direction.kind != "none":
            at = ("rules", i, "state") if rule.state is not None else ("defaults", "state")
            yield (f"rule '{rule.name}': int8 momentum under a spectral map, which lifts the rounding noise in a "
                   f"low-rank momentum's near-null directions into the update; state: int8-ec on this rule (its "
                   f"4-bit corrections cut that noise tenfold, at 0.38 of float32's bytes) or bfloat16 keeps "
                   f"the rest in int8"), at


#: a Kronecker factor's side above which its refreshes (an eigh or a root, O(n³)) and its n² entries
#: cost more than the step they precondition
KRONECKER_SIDE = 4096


@lint_rule("GO129", "large-kronecker-factor", "warning")
def large_kronecker_factor(ctx: LintContext):
    """A ``kronecker`` rule that keeps a factor on a side longer than 4096.

    Each kept side of n keeps an n × n factor (and a root or a basis as large) and recomputes it every ``every``
    steps by an eigendecomposition or a root iteration (PSGD: triangular matmuls and solves), O(n³): a
    vocabulary-sized side (50,257 for GPT-2's embedding) holds 10 GB per factor and takes minutes per refresh.
    Shampoo implementations precondition such a matrix on its short side only, PSGD-Kron with a diagonal factor
    on its long side; ``max_dim`` says the same here.

    Bad: ``geometry: {kind: kronecker}`` over a (50257, 768) embedding. Fixed: ``geometry: {kind: kronecker,
    max_dim: 4096}`` (its long side steps as the identity; under ``method: psgd``, with a diagonal factor).
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind != "kronecker":
            continue
        limit = rule.geometry.max_dim
        for p in ctx.owned(i):
            if len(p.shape) < 2:
                continue
            sides = (p.shape[0], math.prod(p.shape[1:]))
            big = [s for s in sides if s > KRONECKER_SIDE and (limit is None or s <= limit)]
            if big:
                instead = ("a diagonal factor on its long side" if rule.geometry.method == "psgd"
                           else "its short side only")
                yield (f"rule '{rule.name}' keeps a {max(big)} × {max(big)} factor for '{p.name}' ({shape_text(p)}), "
                       f"recomputed every {rule.geometry.every} steps at O(n³); set max_dim: {KRONECKER_SIDE} to "
                       f"precondition with {instead}"), ("rules", i, "geometry", "kind")
                break
