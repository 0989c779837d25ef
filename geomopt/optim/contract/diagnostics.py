"""Per-rule diagnostics of a running optimizer: the stationarity-gap estimate, the dual norm of
unconstrained lmo rules, distance to the constraint set, update norm, skipped steps and
fallbacks."""

from __future__ import annotations

import math
from typing import Any

import torch

from geomopt.compile.fragments import ResolvedGeometry
from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import is_dtensor
from geomopt.geometry.gap import dual_norm, gap_unavailable, stationarity_gap
from geomopt.geometry.prox import backward
from geomopt.optim.engine.tensors import full, op_view, upcast
from geomopt.optim.contract.torch_api import dense
from geomopt.spec.geometries import Euclidean

_EUCLIDEAN = Euclidean()


def euclidean_geometry(pp: ParamPlan) -> ResolvedGeometry:
    """The Euclidean geometry for P_C (project_on_init, the violation): spectral sets act per
    matrix of the plan's ``view``, as the rule's own backward step does."""
    return ResolvedGeometry(_EUCLIDEAN, pp.geometry.view)


@torch.no_grad()
def diagnostics(opt: Any, *, gap_reference: str = "auto") -> dict[str, dict]:
    """Per rule: ``gap`` (stationarity-gap estimate, W of the last step paired with the current
    gradient, :func:`geomopt.geometry.gap.stationarity_gap`; None where undefined or not
    tracked; NaN while a gradient is non-finite; +∞ where W left dom φ₁), ``gap_note`` (None
    where ``gap`` is a finite sum over all the rule's tensors, else why not, naming the rule and
    what to look at instead), ``dual_norm`` (ρ‖G‖_* where g ≡ 0),
    ``violation`` (max distance of a tensor to its constraint set), ``update_norm`` (of the last
    step), ``skipped`` and ``fallbacks`` (steps where the backward step was undefined and the
    Euclidean projection was used). A tensor whose numbers cannot be measured (a parameter, a
    gradient or a W holding NaN or ±∞; a factorization that fails) makes the rule's sums and
    maxima it enters NaN, never an exception: diagnostics are what one reads when training
    goes wrong. Zero-size tensors enter nothing. ``gap_reference``: ``"auto"`` (default), ``"declared"`` or
    ``"realized"``, the reference Newton–Schulz / Polar Express rules are measured against
    (:mod:`geomopt.geometry.gap`). Syncs with the device: call it every N steps."""
    def note(rule, pp, why, gap, measured, outside, unpaired, bad_w, unmeasurable):
        """A rule's ``gap_note``: None where its gap is a finite sum over all its tensors."""
        head = f"rule {rule!r} ({pp.geometry.kind} geometry): "
        if pp.geometry.kind != "adam" and pp.constraint is None:
            return head + "no constraint (g ≡ 0): the gap of the lmo method is ρ‖G‖_*, reported as dual_norm"
        if why is not None:
            return head + why
        if not opt.track_gap:
            return head + "not tracked: GeomOptimizer(..., track_gap=True) keeps the W of each step for the gap"
        if gap is not None and math.isnan(gap) and bad_w:
            return head + (f"W of the last step is non-finite for {bad_w} tensor(s): a parameter or the "
                           "optimizer state holds NaN or ±∞ (see violation): no estimate")
        if gap is not None and math.isnan(gap) and unmeasurable:
            return head + (f"the gap of {unmeasurable} tensor(s) is not representable in the working dtype "
                           "(its SVD failed, or a term is ∞ − ∞: e.g. entries near the dtype's limits): no "
                           "estimate")
        if gap is not None and math.isnan(gap):
            return head + "a gradient is non-finite (the step is skipped): no estimate"
        if gap is None and not unpaired:
            return head + "no gradient: the gap pairs the current gradient with the W of the last step"
        if gap is None:
            return head + "no W yet: the gap pairs the W of the last step with the current gradient"
        if outside:
            return head + (f"W of the last step lies outside dom φ₁ for {outside} of {measured} tensor(s), so "
                           "the Fenchel–Young gap is +∞: the barrier step was undefined there and fell back to "
                           "the Euclidean projection (see fallbacks; e.g. a Newton–Schulz / Polar Express "
                           "forward whose singular values overshoot 1)")
        if unpaired:
            return head + (f"the sum over {measured} of {measured + unpaired} tensors: the others have a "
                           "gradient but no W from the last step")
        return None

    out = {}
    engine = opt.engine
    for group, plans, counters in zip(opt.param_groups, engine.plans, engine.counters):
        gap = dual = None
        violation = 0.0
        first = plans[0]
        why = gap_unavailable(first.geometry, first.constraint, gap_reference)
        measured = outside = unpaired = 0  # tensors: with a gap value, +∞ among them, gradient but no W
        bad_w = unmeasurable = 0  # tensors whose W is non-finite; whose gap is NaN from a finite W
        for p, pp in zip(group["params"], plans):
            if not p.numel():
                continue  # zero-size: never steps, nothing to measure
            rho = group["radius"] * pp.radius / pp.geometry.radius
            g = None if p.grad is None else upcast(op_view(full(dense(p.grad)), pp))
            if pp.constraint is not None and pp.constraint.kind != "proximal_decay":
                x = upcast(op_view(full(p), pp))
                violation = _worst(violation, _measured(_distance, x, pp))
            if g is None:
                continue
            w = opt.state[p].get("w")
            if w is not None and is_dtensor(w):
                w = op_view(full(w), pp)
            lmo_gap = pp.constraint is None and pp.geometry.kind != "adam"
            if not bool(torch.isfinite(g).all()):
                # a non-finite gradient (a skipped step): no estimate, and no SVD of it
                if lmo_gap:
                    dual = math.nan
                elif w is not None:
                    gap = math.nan
            elif lmo_gap:
                # g ≡ 0: the gap of the lmo method is ρ‖G‖_*
                dual = (dual or 0.0) + rho * _measured(dual_norm, g, pp.geometry)
            elif w is not None:
                finite_w = bool(torch.isfinite(w).all())
                val = _gap_of(g, w, pp, gap_reference, rho) if finite_w else math.nan
                if val is not None:
                    gap = (gap or 0.0) + val
                    measured += 1
                    outside += math.isinf(val)
                    bad_w += not finite_w
                    unmeasurable += finite_w and math.isnan(val)
            elif pp.constraint is not None:
                unpaired += 1
        update_sq = counters["update_sq"]
        if engine.options.sharded:  # each rank holds the squared norm of its shards' update
            update_sq = update_sq.clone()
            engine.executor.dist.all_reduce(update_sq, group=engine.executor.group)
        out[group["rule"]] = dict(
            gap=gap,
            gap_note=note(group["rule"], first, why, gap, measured, outside, unpaired, bad_w, unmeasurable),
            dual_norm=dual, violation=violation,
            update_norm=float(update_sq) ** 0.5 if opt.track_update else None, skipped=int(counters["skipped"]),
            fallbacks=int(counters["fallbacks"]),
        )
    return out



def _distance(x: torch.Tensor, pp: ParamPlan) -> torch.Tensor:
    """‖X − P_C(X)‖_F, P_C the Euclidean projection onto the plan's constraint set."""
    return (x - backward(x, 1.0, euclidean_geometry(pp), pp.constraint)[0]).norm()


def _measured(fn, x: torch.Tensor, *args) -> float:
    """``float(fn(x, *args))``, or NaN where ``x`` is non-finite (``fn`` is not run then: an SVD or
    eigh of a NaN raises) or ``fn`` raises a factorization error (finite entries past the working
    dtype's range)."""
    if not bool(torch.isfinite(x).all()):
        return math.nan
    try:
        return float(fn(x, *args))
    except torch.linalg.LinAlgError:
        return math.nan


def _gap_of(g: torch.Tensor, w: torch.Tensor, pp: ParamPlan, reference: str, rho: float) -> float | None:
    """A tensor's stationarity gap (``g`` and ``w`` finite), NaN where its SVD fails, None where it
    is undefined."""
    try:
        val = stationarity_gap(g, w, pp.geometry, constraint=pp.constraint, reference=reference, radius=rho)
    except torch.linalg.LinAlgError:
        return math.nan
    return None if val is None else float(val)


def _worst(a: float, b: float) -> float:
    """max(a, b), NaN if either is (Python's max drops a NaN that comes second)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
