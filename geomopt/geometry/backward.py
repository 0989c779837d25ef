"""Backward (proximal) steps: X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y), paper eq. (update), Table 1.

With φ = ρ⋆φ₁ the step sees only t = γρ: (γ⋆φ)(Z − Y) = t·φ₁((Z − Y)/t). One small function per
row of the backward table (paper Table 1), registered under the ``(geometry, constraint)`` pairs its
row of :data:`geomopt.catalog.BACKWARD_TABLE` names; the contract is in :mod:`geomopt.geometry.registry`::

    fn(y, t, ref, constraint: dict, *, gamma, geometry: dict, batch_dims) -> (x, fallback)

The leading ``batch_dims`` dims of ``y`` index independent tensors; every norm, sum and SVD is per
batch element. Spectral ops view an element as a (shape[0], prod(rest)) matrix; a geometry's
``view`` (experts, blocks: :mod:`geomopt.geometry.view`) makes it several matrices, each with its
own constraint, and :func:`backward` hands the op each stack of them.

Conventions shared by every op (documented once here):

* Numerics: float32 (float64 for float64 input; bfloat16/float16 upcast), result in the input
  dtype. Scalar solves use a fixed number of steps (no host syncs): safeguarded Newton for the
  ball, halvings for the sphere.
* Every projection onto a set is independent of ε: h_ε = ε·h₁ only rescales the objective. The
  scalar solves therefore run with ε = 1 and a dimensionless multiplier τ = tν; only κ matters.
* Feasibility: with a barrier or indicator reference the step is defined only if C meets
  Y + t·dom φ₁ (dom φ₁ = unit ball of ‖·‖∞ for anisotropic, of the spectral norm for spectral, of
  ‖·‖_F for isotropic, of the max row/column norm for rowwise/columnwise). Where it does not, the op
  returns the Euclidean projection P_C(Y) and sets ``fallback``. The test is the closed one with a
  rounding slack of 8u·(scale + t) (u of the *input* dtype): X ∈ C puts Y − X exactly on t·∂dom φ₁
  for the indicator (lmo forward), and for barriers with small ε after rounding, and these steps
  are well defined (as the limit of the barrier solutions).
* Indicator reference (h = δ_[−1,1]): the prox is set-valued (every point of C ∩ (Y + t·dom φ₁)).
  We return the limit κ → ∞ of the power-barrier steps, which is the Euclidean projection of Y onto
  C ∩ (Y + t·dom φ₁): for the ℓ2 ball |x_i| = max(|y_i|/(1+τ), |y_i| − t) (a shrink floored by the
  soft-threshold), for the sphere outward |x_i| = min(|y_i|/(1−τ), |y_i| + t).
* Ties and zeros: sign(0) := +1; top-k keeps the earliest index among equal magnitudes; at Y = 0
  spheres pick (r/√n)·(1, …, 1) (the symmetric point the anisotropic step itself produces) and
  spectral sets pick the "identity" frame U = I[:, :q], V = I[:, :q] (Stiefel: r·I_{m×n}).
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import Callable

import torch

# the constraint kinds and the backward table (which op serves which pairs) are plain data there
from geomopt.catalog import CONSTRAINT_KINDS, SEPARABLE_SETS, SET_KINDS, SPECTRAL_SETS  # noqa: F401
from geomopt.geometry import method as method_choice
from geomopt.geometry.reference import Quadratic, Reference, make_reference
from geomopt.geometry.registry import BACKWARD_OPS, backward_op, supported_constraints
from geomopt.geometry.view import apply as apply_view
from geomopt.geometry.view import split_view


# ---------------------------------------------------------------- public entry point


def backward(
    y: torch.Tensor,
    gamma: float,
    geometry: dict,
    constraint: dict | None,
    *,
    radius: float | None = None,
    batch_dims: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward step X⁺ ∈ argmin_Z g(Z) + (γ⋆φ)(Z − Y) for one geometry and constraint
    (spec fragments as plain dicts). ``radius`` overrides ``geometry["radius"]`` (ρ); t = γρ.

    Returns ``(x, fallback)``; ``(y, None)`` without a constraint. Raises ValueError for a
    (geometry, constraint) pair with no operator, naming the constraints that geometry supports.
    """
    if constraint is None:
        return y, None
    gkind, ckind = geometry["kind"], constraint["kind"]
    op = BACKWARD_OPS.get((gkind, ckind))
    if op is None:
        raise ValueError(_unsupported_message(gkind, ckind))
    rho = float(radius if radius is not None else geometry.get("radius", 1.0))
    ref = make_reference(geometry["reference"]) if geometry.get("reference") else Quadratic()
    view, plain = split_view(geometry, y.shape[batch_dims:])
    if view is None:
        return op(y, float(gamma) * rho, ref, constraint, gamma=float(gamma), geometry=geometry, batch_dims=batch_dims)
    scaled = view.get("scale_constraint") and "radius" in constraint

    def per_stack(mats, f):
        c = {**constraint, "radius": constraint["radius"] * f} if scaled and f != 1.0 else constraint
        return op(mats, float(gamma) * rho * f, ref, c, gamma=float(gamma), geometry=plain, batch_dims=1)

    return apply_view(y, batch_dims, view, per_stack)


def _unsupported_message(gkind: str, ckind: str) -> str:
    supported = supported_constraints(gkind)
    if ckind not in CONSTRAINT_KINDS:
        near = difflib.get_close_matches(ckind, CONSTRAINT_KINDS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown constraint {ckind!r}{hint} {gkind} geometry supports: {', '.join(supported) or 'none'}"
    return (
        f"no backward step for constraint {ckind!r} under {gkind!r} geometry; "
        f"{gkind} geometry supports: {', '.join(supported) or 'none (no constraint)'}"
    )


# ---------------------------------------------------------------- shared helpers


def _work_dtype(y: torch.Tensor) -> torch.dtype:
    return torch.float64 if y.dtype == torch.float64 else torch.float32


def _flat(y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """(B, n) in the working dtype, B = prod(batch shape) (1 when batch_dims = 0)."""
    return y.to(_work_dtype(y)).reshape(math.prod(y.shape[:batch_dims]), -1)


def _unflat(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.reshape(y.shape).to(y.dtype)


def _per_element(flag: torch.Tensor, y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    return flag.reshape(y.shape[:batch_dims])


def _slack(scale: torch.Tensor, t: float, dtype: torch.dtype) -> torch.Tensor:
    """Rounding slack for the feasibility test: Y = X − t·W carries errors of u·(|X| + t)."""
    return 8 * torch.finfo(dtype).eps * (scale + t)


def _too_far(dist: torch.Tensor, t: float, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """True where dist(Y, C) in the geometry's norm exceeds t (beyond rounding)."""
    return dist > t + _slack(scale, t, y.dtype)


def _sign(y: torch.Tensor) -> torch.Tensor:
    """sign with sign(0) := +1 (deterministic point for zero entries)."""
    return torch.where(y < 0, -torch.ones_like(y), torch.ones_like(y))


def _norm(v: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(v, dim=-1)


def _bisection_steps(dtype: torch.dtype) -> int:
    # log τ lives in [−60 ln2, 60 ln2] (width 83). The final interpolation (:func:`_interpolate`,
    # second order in the bracket's width) recovers full precision from a bracket of 83·2⁻²⁴ ≈ 5e-6
    # (fp32) or 83·2⁻³⁶ ≈ 1e-9 (fp64). Measured against 40 / 64 halvings (brackets below 1e-10 /
    # 5e-18): the same σ to ≤ 3e-7 / ≤ 1e-15 relative over the power barrier (κ = 1, 2, 4, 16),
    # log barrier and indicator, t/r ∈ [1e-4, 20], balls and spheres; 16 / 28 halvings start to
    # lose digits (5e-7 / 1e-14), so 8 halvings of margin.
    return 36 if dtype == torch.float64 else 24


_LOG_TAU = 60 * math.log(2.0)


def _ref_profile(ref: Reference) -> str:
    if ref.kind in ("quadratic", "log_barrier", "indicator", "power_barrier"):
        return ref.kind
    raise ValueError(f"backward steps do not know reference {ref.kind!r}")


# ---------------------------------------------------------------- scalar solves (magnitudes)
#
# Everything below works in units of t: α = |y_i|/t, σ = |x_i|/t, ϱ = r/t, and the multiplier
# τ = t·ν/ε (dimensionless, ε-free). Inputs are (B, n) magnitudes α ≥ 0.


def _ball_sigma(alpha: torch.Tensor, tau: torch.Tensor, ref: Reference, start: torch.Tensor | None) -> torch.Tensor:
    """σ(τ) solving σ + (h₁*)'(τσ) = α, σ ≥ 0 (Appendix A.1 with x = sign(y)·tσ), in closed form:
    log barrier and indicator (the power barrier: :func:`_solve_ball`, :func:`_power_sigma`)."""
    return _log_ball_sigma(alpha, tau) if ref.kind == "log_barrier" else _box_sigma(alpha, tau)


def _log_ball_sigma(alpha: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    # τσ² + bσ − α = 0, b = 1 + τ(1 − α): the cancellation-free root (paper Appendix A.1).
    b = 1 + tau * (1 - alpha)
    d = torch.hypot(b, 2 * torch.sqrt(tau * alpha))
    return torch.where(b > 0, 2 * alpha / (b + d), (d - b) / (2 * tau))


def _box_sigma(alpha: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    # κ → ∞: (h₁*)' = clip(·, −1, 1), so σ = α/(1+τ) until the box |x − y| ≤ t binds.
    return torch.maximum(alpha / (1 + tau), alpha - 1)


def _sphere_sigma(alpha: torch.Tensor, tau: torch.Tensor, ref: Reference, start: torch.Tensor | None) -> torch.Tensor:
    """σ(τ) solving σ − (h₁*)'(τσ) = α with σ ≥ α (outward sphere step, the largest root): log
    barrier and indicator (the power barrier: :func:`_power_sigma`)."""
    if ref.kind == "log_barrier":
        # τσ² + cσ − α = 0, c = 1 − τ(1 + α) (α = 0 gives σ = max(0, 1 − 1/τ)).
        c = 1 - tau * (1 + alpha)
        d = torch.hypot(c, 2 * torch.sqrt(tau * alpha))
        return torch.where(c <= 0, (d - c) / (2 * tau), 2 * alpha / (c + d))
    # κ → ∞ limit; at τ = 1 zero entries jump 0 → 1: the final interpolation fills the gap.
    grow = alpha / (1 - tau).clamp(min=torch.finfo(alpha.dtype).tiny)
    return torch.where(tau * (alpha + 1) < 1, grow, alpha + 1)


def _power_sigma(alpha: torch.Tensor, tau: torch.Tensor, ref: Reference, start: torch.Tensor | None,
                 inward: torch.Tensor) -> torch.Tensor:
    """The power barrier's σ(τ) for the sphere's solve: the root of H(σ) = σ + c·f(τσ) − α,
    f = (h₁*)', with c = +1 on the rows where ``inward`` (B, 1) (the ball: H concave increasing:
    Newton from a point left of the root, H ≤ 0, climbs monotonically to it, clamped to
    [start, α]) and c = −1 on the others (outward: H convex: Newton from the right, H ≥ 0,
    descends monotonically to the largest root, clamped to [α, start])."""
    tiny = torch.finfo(alpha.dtype).eps
    c = torch.where(inward, 1.0, -1.0).to(alpha.dtype)
    if start is None:
        start = torch.where(inward, alpha.sub(1).clamp(min=0), alpha + 1)
    lower, upper = torch.where(inward, start, alpha), torch.where(inward, alpha, start)
    s = start
    for _ in range(_NEWTON_STEPS):
        f, fp = _unit_dual(tau * s, ref.kappa)
        num = torch.addcmul(s, c, f).sub_(alpha)
        den = fp.mul_(tau).mul_(c).add_(1).clamp_(min=tiny)
        s = torch.addcdiv(s, num, den, value=-1).clamp_(min=lower, max=upper)
    return s


def _unit_dual(u: torch.Tensor, kappa: float) -> tuple[torch.Tensor, torch.Tensor]:
    """((h₁*)'(u), (h₁*)''(u)) = (u·g, g^{κ+1}), g = (1 + u^κ)^{−1/κ} (:meth:`PowerBarrier.iso_factor`
    at ε = 1), for u ≥ 0. u is capped below the overflow of u^κ, where (h₁*)' = 1 and (h₁*)'' = 0
    to the working precision. For κ = 2^j (j ≥ 1) by j squarings, j − 1 square roots and a
    reciprocal one (a fifth of the time of two powers)."""
    uc = u.clamp(max=torch.finfo(u.dtype).max ** (1 / kappa) / 2)
    j = math.log2(kappa)
    if j.is_integer() and 1 <= j <= 6:
        q = uc.square()
        for _ in range(int(j) - 1):
            q.square_()
        g = q.add_(1).sqrt()
        for _ in range(int(j) - 1):
            g.sqrt_()
        g = g.reciprocal_()
    else:
        q = uc.pow(kappa).add_(1)
        g = q.pow(-1 / kappa)
    return g * uc, g.div_(q)


def _signed_sigma(alpha: torch.Tensor, tau: torch.Tensor, ref: Reference, start: torch.Tensor | None,
                  inward: torch.Tensor) -> torch.Tensor:
    """:func:`_ball_sigma` on the rows where ``inward`` (B, 1), :func:`_sphere_sigma` on the others,
    in one evaluation for the power barrier (one Newton loop for both kinds)."""
    if ref.kind == "power_barrier":
        return _power_sigma(alpha, tau, ref, start, inward)
    return torch.where(inward, _ball_sigma(alpha, tau, ref, start), _sphere_sigma(alpha, tau, ref, start))


# Newton steps per bisection step of the sphere's solve. Warm starts (σ at the bracket end on the
# safe side) keep every solve close to its root: measured, 4 steps reproduce 60-step results to
# 1e-15 over κ ∈ [1, 64] and t/r ∈ [1e-4, 20] (a cold start needs up to 16); 6 leaves a margin.
_NEWTON_STEPS = 6


def _interpolate(sig_a: torch.Tensor, sig_b: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Blend squares elementwise so that Σσ² = target exactly; keeps each σ between σ_a and σ_b
    (hence inside the box |x − y| ≤ t) and resolves the jump of the indicator sphere."""
    a = (sig_a * sig_a).sum(-1, keepdim=True)
    b = (sig_b * sig_b).sum(-1, keepdim=True)
    den = b - a
    theta = torch.where(den != 0, (target - a) / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(den))
    theta = theta.clamp(0, 1)
    return torch.sqrt((sig_a * sig_a + theta * (sig_b * sig_b - sig_a * sig_a)).clamp(min=0))


def _ball_magnitudes(a: torch.Tensor, t: float, r: float, ref: Reference, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Anisotropic ℓ2-ball step on magnitudes a (B, n) ≥ 0 (paper Appendix A.1):
    s = a if ‖a‖ ≤ r, else s_i = t·σ_i(τ) from σ + (h₁*)'(τσ) = a/t with τ such that Σs² = r²
    (:func:`_solve_ball`). Returns (s, infeasible) — infeasible where Σ(a_i − t)₊² > r², i.e. the
    ball misses Y + t·dom φ₁; there s is the Euclidean projection a·r/‖a‖."""
    if _ref_profile(ref) == "quadratic":
        return _proj_l2_ball(a, r), None
    return _ball_finish(a, _solve_ball(a / t, (r / t) ** 2, ref) * t, t, r, dtype)


def _ball_finish(a: torch.Tensor, s: torch.Tensor, t: float, r: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ball step's magnitudes from the solve's s: a where ‖a‖ ≤ r, s landed on the ball
    exactly (a safeguard for the boundary cases inside the slack), and the Euclidean projection
    where infeasible; with the infeasibility flags."""
    slack = _slack(a.amax(-1), t, dtype).unsqueeze(-1)
    bad = ((a - t - slack).clamp(min=0).square().sum(-1) > r * r)
    s = torch.where((_norm(a) <= r).unsqueeze(-1), a, _proj_l2_ball(s, r))
    return torch.where(bad.unsqueeze(-1), _proj_l2_ball(a, r), s), bad


def _newton_steps(dtype: torch.dtype, kappa: float) -> int:
    # Measured against 120 halvings in float64 (power barrier κ = 1, 1.5, 2, 3, 4, 16, 64, log
    # barrier; 3, 64 and 300 entries uniform, |Gaussian|, over four decades, two or one nonzero,
    # all equal; t/r from 1e-4 to 20; ‖a‖ from just outside r to a millionth short of infeasible):
    # float64 reaches ≤ 5e-12 relative in 8 steps; float32 the float32 conditioning of the problem
    # (as the former 24 halvings did) in 4 for κ ≥ 3 (κ = 2 needs 5, κ = 1 and the log barrier 8).
    return 4 if dtype != torch.float64 and kappa >= 3 else 8


def _solve_ball(alpha: torch.Tensor, rho2: float, ref: Reference) -> torch.Tensor:
    """σ ≥ 0 with σ_i + (h₁*)'(τσ_i) = α_i (units of t) and Σσ² = ρ², by a safeguarded Newton
    method on τ with a fixed step count (:func:`_newton_steps`; no host syncs).

    Start: the indicator's root (:func:`_box_tau`), exact for the indicator and a lower bound
    otherwise ((h₁*)'(u) ≤ min(u, 1) makes its σ the smallest). Each step: σ(τ) by two Newton steps
    (closed form for the log barrier), which bracket it as s ≤ σ(τ) ≤ upper (H concave, H' ≥ 1);
    the bracket [lo, hi] on τ moves where Σs² > ρ² or Σupper² < ρ² (Σσ² decreases in τ); then
    Newton on Ψ = log(Σσ² − Σσ_∞²) over log(1 + τ), σ_∞ = (α − 1)₊ the τ → ∞ limit — straight for
    the shrink σ = α/(1+τ) and for the power-law tails σ − σ_∞ ~ τ^{−κ} — with the target gap
    floored at u·ρ² (the float rounding of Σσ²). A step that leaves the bracket (beyond its
    rounding) is replaced by bisection in log τ. The result is scaled onto Σσ² = ρ² exactly."""
    tau = _box_tau(alpha, rho2)
    lim = (alpha - 1).clamp_(min=0)
    s = torch.maximum(alpha / (tau + 1), lim)  # the indicator's σ
    if ref.kind == "indicator":
        return s * (rho2 / (s * s).sum(-1, keepdim=True)).sqrt()
    power = ref.kind == "power_barrier"
    eps = torch.finfo(alpha.dtype).eps
    lo, hi = tau, torch.full_like(tau, _TAU_MAX)
    steps = _newton_steps(alpha.dtype, ref.kappa if power else 1.0)
    for step in range(steps + 1):
        s, upper, rate = _ball_newton(alpha, lim, tau, s, ref.kappa) if power else _ball_log(alpha, tau)
        total = (s * s).sum(-1, keepdim=True)
        if step == steps:
            return s * (rho2 / total).sqrt()
        lo = torch.where(total > rho2, tau, lo)
        hi = torch.where((upper * upper).sum(-1, keepdim=True) < rho2, tau, hi)
        slope = (s * rate).sum(-1, keepdim=True)  # −½·dΣσ²/dτ
        gap = ((s - lim) * (s + lim)).sum(-1, keepdim=True)
        dtau = gap * torch.log(gap / (gap - total + rho2).clamp(min=eps * rho2)) / (2 * slope)
        grow = tau + 1
        new = torch.expm1(dtau / grow).mul_(grow).add_(tau)
        slack = 8 * eps * ((total + rho2) / (2 * slope) + grow)
        inside = (new >= lo - slack) & (new <= hi + slack)  # NaN is outside
        new = torch.where(inside, torch.minimum(torch.maximum(new, lo), hi), (lo * hi).sqrt())
        s, tau = s - rate * (new - tau), new  # first-order predictor of σ(new)


_TAU_MAX = 2.0**60


def _ball_newton(alpha: torch.Tensor, lim: torch.Tensor, tau: torch.Tensor, s: torch.Tensor, kappa: float):
    """Two Newton steps on H(σ) = σ + (h₁*)'(τσ) − α (power barrier) from s, clamped to the
    indicator's σ = max(α/(1+τ), lim) below (a lower bound) and α above: H is concave with H' ≥ 1,
    so each lands at or below the root and the root is at most s − min(H(s), 0). Returns (σ, that
    upper bound, −dσ/dτ = σ·f'/(1 + τf') with f' at the last start)."""
    floor = torch.maximum(alpha / (tau + 1), lim)
    s = torch.minimum(torch.maximum(s, floor), alpha)
    for _ in range(2):
        f, fp = _unit_dual(tau * s, kappa)
        h = f.add_(s).sub_(alpha)
        d = fp.mul(tau).add_(1)
        upper = s - h.clamp(max=0)
        s = torch.addcdiv(s, h, d, value=-1).clamp_(min=floor, max=alpha)
    return s, upper, s * fp / d


def _ball_log(alpha: torch.Tensor, tau: torch.Tensor):
    """The log barrier's σ(τ) in closed form, as (σ, σ, −dσ/dτ = σ·f'/(1 + τf'), f' = 1/(1 + τσ)²)."""
    s = _log_ball_sigma(alpha, tau)
    fp = (tau * s).add_(1).pow_(-2)
    return s, s, s * fp / fp.mul(tau).add_(1)


def _box_tau(alpha: torch.Tensor, rho2: float) -> torch.Tensor:
    """τ with Σ max(α/(1+τ), α − 1)₊² = ρ² (the indicator's ball step) exactly, in float64: with α
    sorted descending the first k entries are boxed (at α − 1) and the others shrunk (α·μ,
    μ = 1/(1+τ)) on the piece between the k-th and (k+1)-th breakpoints μ_k = 1 − 1/α_k, where
    Σσ² = C_k + A_k·μ² (C_k = Σ_{i≤k}(α_i − 1)₊², A_k = Σ_{i>k} α_i²); k counts the breakpoints
    at which Σσ² still exceeds ρ². Capped at _TAU_MAX (infeasible rows)."""
    a = torch.sort(alpha.double(), dim=-1, descending=True).values
    zero = torch.zeros_like(a[..., :1])
    boxed = torch.cat([zero, (a - 1).clamp(min=0).square().cumsum(-1)], -1)
    shrunk = torch.cat([a.square().flip(-1).cumsum(-1).flip(-1), zero], -1)
    mu = torch.cat([torch.ones_like(zero), (1 - 1 / a).clamp(min=0), zero], -1)
    k = (boxed[..., 1:] + shrunk[..., 1:] * mu[..., 1:-1].square() > rho2).sum(-1, keepdim=True)
    root = ((rho2 - boxed.gather(-1, k)) / shrunk.gather(-1, k)).clamp(min=0).sqrt()
    root = torch.minimum(torch.maximum(root, mu.gather(-1, k + 1)), mu.gather(-1, k))
    return (1 / root - 1).clamp(max=_TAU_MAX).to(alpha.dtype)


def _solve_tau(sigma: Callable, a: torch.Tensor, t: float, r: float, ref: Reference, *, decreasing) -> torch.Tensor:
    """The sphere's solve: s = t·σ(α, τ) with Σs² = r², α = a/t, by bisection on
    log τ ∈ [−_LOG_TAU, _LOG_TAU] (Σσ² decreasing in τ on the rows where ``decreasing`` (B, 1):
    the ball's σ, increasing on the others: the sphere's outward σ), then linear interpolation
    between the bracket's ends (:func:`_interpolate`). The power barrier's σ is warm-started from
    the bracket's upper end."""
    alpha, rho2 = a / t, (r / t) ** 2
    lo = torch.full_like(a[..., :1], -_LOG_TAU)
    hi = -lo
    sig_hi = None if ref.kind != "power_barrier" else sigma(alpha, hi.exp(), ref, None)
    for _ in range(_bisection_steps(a.dtype)):
        mid = (lo + hi) / 2
        sig = sigma(alpha, mid.exp(), ref, sig_hi)
        total = (sig * sig).sum(-1, keepdim=True)
        up = torch.where(decreasing, total > rho2, total < rho2)  # the root lies above mid
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
        if sig_hi is not None:
            sig_hi = torch.where(up, sig_hi, sig)
    s_hi = sigma(alpha, hi.exp(), ref, sig_hi)
    s_lo = sigma(alpha, lo.exp(), ref, s_hi)
    return _interpolate(s_lo, s_hi, torch.full_like(lo, rho2)) * t


def _sphere_euclid(a: torch.Tensor, r: float) -> torch.Tensor:
    """Euclidean projection of magnitudes onto the sphere; a = 0 → (r/√n)·1."""
    norm = _norm(a).unsqueeze(-1)
    n = a.shape[-1]
    return torch.where(norm > 0, a * r / norm.clamp(min=torch.finfo(a.dtype).tiny), torch.full_like(a, r / math.sqrt(n)))


def _sphere_magnitudes(a: torch.Tensor, t: float, r: float, ref: Reference, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Anisotropic sphere step on magnitudes (paper Appendix A.1, outward): the ball step if ‖a‖ ≥ r, else the outward
    bisection with |x_i| ≥ |y_i| (:func:`_sphere_sigma`, Σs² increasing in τ); infeasible where
    Σ(a_i + t)² < r² (outward) or the ball step is infeasible (inward)."""
    euclid = _sphere_euclid(a, r)
    if _ref_profile(ref) == "quadratic":
        return euclid, None
    inward = (_norm(a) >= r).unsqueeze(-1)
    # one solve for both kinds of rows (:func:`_signed_sigma`)
    s = _solve_tau(functools.partial(_signed_sigma, inward=inward), a, t, r, ref, decreasing=inward)
    s_in, bad_in = _ball_finish(a, s, t, r, dtype)
    slack = _slack(a.amax(-1), t, dtype).unsqueeze(-1)
    bad_out = (a + t + slack).square().sum(-1) < r * r
    s_out = s * (r / _norm(s).clamp(min=torch.finfo(a.dtype).tiny)).unsqueeze(-1)
    s = torch.where(inward, s_in, s_out)
    bad = torch.where(inward.squeeze(-1), bad_in, bad_out)
    return torch.where(bad.unsqueeze(-1), euclid, s), bad


# ---------------------------------------------------------------- Euclidean projections (vectors)


def _proj_l2_ball(v: torch.Tensor, r: float) -> torch.Tensor:
    return v * (r / _norm(v).clamp(min=torch.finfo(v.dtype).tiny)).clamp(max=1).unsqueeze(-1)


def _proj_sphere(v: torch.Tensor, r: float) -> torch.Tensor:
    return _sign(v) * _sphere_euclid(v.abs(), r)


def _proj_linf_ball(v: torch.Tensor, r: float) -> torch.Tensor:
    return v.clamp(-r, r)


def _proj_linf_sphere(v: torch.Tensor, r: float) -> torch.Tensor:
    """Clip if ‖v‖∞ ≥ r, else move the first max-magnitude entry to sign(v_j)·r (Appendix A.2)."""
    mag = v.abs()
    j = torch.argmax(mag, dim=-1, keepdim=True)  # first index among ties
    lifted = v.scatter(-1, j, _sign(v.gather(-1, j)) * r)
    return torch.where(mag.amax(-1, keepdim=True) >= r, v.clamp(-r, r), lifted)


def _proj_sign_set(v: torch.Tensor, r: float) -> torch.Tensor:
    return r * _sign(v)


def _keep_top(v: torch.Tensor, k: int) -> torch.Tensor:
    """Zero all but the k largest |v_i|; a stable descending sort keeps the earliest of equals."""
    if k >= v.shape[-1]:
        return v.clone()
    order = torch.sort(v.abs(), dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(v, dtype=torch.bool).scatter(-1, order[..., :k], True)
    return torch.where(keep, v, torch.zeros_like(v))


_VECTOR_PROJ: dict[str, Callable] = {
    "l2_ball": lambda v, c: _proj_l2_ball(v, c["radius"]),
    "frobenius_ball": lambda v, c: _proj_l2_ball(v, c["radius"]),
    "frobenius_sphere": lambda v, c: _proj_sphere(v, c["radius"]),
    "linf_ball": lambda v, c: _proj_linf_ball(v, c["radius"]),
    "linf_sphere": lambda v, c: _proj_linf_sphere(v, c["radius"]),
    "sign_set": lambda v, c: _proj_sign_set(v, c["radius"]),
    "l0": lambda v, c: _keep_top(v, c["k"]),
}


# ---------------------------------------------------------------- matrices and SVD


def _matrices(y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """(B, m, n) in the working dtype: each element as (shape[0], prod(rest))."""
    shape = y.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    n = math.prod(shape[1:]) if len(shape) > 1 else 1
    return y.to(_work_dtype(y)).reshape(-1, m, n)


def _element_any(flag: torch.Tensor, y: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """Per-matrix flags (B,) → per-element (batch shape)."""
    return flag.reshape(y.shape[:batch_dims])


def _svd(m: torch.Tensor):
    """Reduced SVD with true singular-vector completions (LAPACK) and the identity frame at
    M = 0 (documented deterministic point for Stiefel and spheres)."""
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    q = s.shape[-1]
    zero = (s.amax(-1) == 0)[:, None, None]
    eye_u = torch.eye(m.shape[-2], q, dtype=m.dtype, device=m.device)
    eye_v = torch.eye(q, m.shape[-1], dtype=m.dtype, device=m.device)
    return torch.where(zero, eye_u, u), s, torch.where(zero, eye_v, vh)


def _compose(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    return (u * s.unsqueeze(-2)) @ vh


def _sigma_proj(kind: str, s: torch.Tensor, c: dict) -> torch.Tensor:
    """Euclidean projections of the singular values (Table 1, second half)."""
    if kind == "stiefel":
        return torch.full_like(s, c["radius"])
    if kind == "spectral_ball":
        return s.clamp(max=c["radius"])
    if kind == "spectral_sphere":
        return _proj_linf_sphere(s, c["radius"])
    if kind == "rank":
        return _keep_top(s, c["k"])  # σ is sorted: keeps σ_1 … σ_k
    if kind in ("frobenius_ball", "l2_ball"):
        return _proj_l2_ball(s, c["radius"])
    if kind == "frobenius_sphere":
        return _proj_sphere(s, c["radius"])
    raise KeyError(kind)


# Gram–eigh is used where its error bound is at most this many times the SVD's (see _spectral_map).
_GRAM_TOLERANCE = 8.0


def _spectral_map(mats: torch.Tensor, step: Callable):
    """X = U·Diag(x)·Vᵀ for (x, extra) = step(σ), σ = σ(M) sorted descending per matrix of a batch
    (B, m, n); returns (X, extra). ``step`` must be pure and act per matrix (it may run again on
    some of the matrices, in another dtype): extra is None or one value per matrix.

    Batched Gram–eigh instead of an SVD where it is as accurate: with the small Gram matrix
    G = MᵀM (MMᵀ when wide) = V·Diag(λ)·Vᵀ, σ = √λ and X = M·V·Diag(w)·Vᵀ, w = x/σ (where σ
    rounds to 0 and x = 0, w continues the smallest σ's: M v ≈ 0 there). Eigh of the Gram costs a third
    of an SVD on CPU, but its backward error is u·λ_max: by the Daleckii–Krein formula X moves by
    about ‖M‖·max|Γ_w|·u·λ_max, Γ_w the divided differences of w in λ (the adjacent ones bound
    all of them), against ‖M‖·max(|Γ_x|, max w, 1)·u for the SVD (Γ_x: those of x in σ; max w
    bounds the rotation terms (x_i + x_j)/(σ_i + σ_j)). So, per matrix, with
    R = λ_max·max|Γ_w| / max(|Γ_x|, max w, 1): float32 Gram–eigh where R ≤ 8 (training's steps: σ
    near the set), float64 Gram–eigh where u₆₄·R ≤ 8·u₃₂ (Y far outside, σ spread over decades),
    else the SVD: R is infinite for σ equal to the input's rounding that ``step`` separates (a rank
    cut through a tie: the SVD's own choice is taken), where ``step`` lifts σ = 0 (Stiefel, outward
    sphere steps on a rank-deficient Y: the singular vectors LAPACK completes) and where G's products
    underflow (‖M‖²_F below max(m, n)·tiny/u). M = 0 keeps the identity frame of
    :func:`_svd`. Only the matrices that need it are redone, and only the accepted ones are composed
    (:func:`_gram_compose`); one host sync per call (the choice), one more per redo."""
    unit = torch.finfo(mats.dtype).eps  # the input's rounding (mats: the working dtype)
    x, extra, ratio, frame = _gram_eigh(mats, step, unit)
    # per matrix: 0 done, 1 float64 Gram–eigh, 2 SVD (R infinite: no Gram matrix resolves it)
    higher = 1 if mats.dtype != torch.float64 else 2
    route = torch.where(ratio <= _GRAM_TOLERANCE, 0, torch.where(ratio.isfinite(), higher, 2))
    route, width, zero = torch.stack([route, frame[3], frame[4]]).tolist()  # host sync
    out = _gram_compose(mats, x, frame, [i for i, r in enumerate(route) if r == 0], width, zero)
    redo = [i for i, r in enumerate(route) if r == 1]
    svd = [i for i, r in enumerate(route) if r == 2]
    if redo:
        out, extra, failed = _float64_redo(mats, redo, step, unit, out, extra)
        svd += failed
    if svd:
        rows = torch.tensor(sorted(svd), device=mats.device)
        u, s, vh = _svd(mats[rows])
        xs, extra_s = step(s)
        out[rows], extra = _compose(u, xs, vh), _put(extra, rows, extra_s)
    return out, extra


def _float64_redo(mats: torch.Tensor, redo: list, step: Callable, unit: float, out: torch.Tensor, extra):
    """The float64 Gram–eigh attempt of :func:`_spectral_map` on the matrices ``redo``: composed into
    ``out`` (and ``extra``) where u₆₄·R ≤ 8·u (u: the input's rounding); returns (out, extra, the
    others, for the SVD)."""
    rows = torch.tensor(redo, device=mats.device)
    m64 = (mats if len(redo) == len(mats) else mats[rows]).double()
    x, extra64, ratio, frame = _gram_eigh(m64, step, unit)
    bad, width, zero = torch.stack([ratio > _GRAM_TOLERANCE * unit / torch.finfo(torch.float64).eps,
                                    frame[3], frame[4]]).tolist()  # host sync
    good = [j for j, b in enumerate(bad) if not b]
    composed = _gram_compose(m64, x, frame, good, width, zero).to(out.dtype)
    if len(good) == len(mats):
        out = composed
    else:
        out[rows[good]] = composed[good]
    return out, _put(extra, rows, extra64), [i for i, b in zip(redo, bad) if b]


def _put(t: torch.Tensor | None, rows: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with ``rows`` replaced by ``values`` (None stays None)."""
    if t is None:
        return None
    t = t.clone()
    t[rows] = values.to(t.dtype)
    return t


def _gram_eigh(work: torch.Tensor, step: Callable, unit: float):
    """One Gram–eigh attempt of :func:`_spectral_map` in ``work``'s dtype (``unit``: the input's
    rounding): (x, extra, R per matrix, frame) with frame = (V (eigh's ascending order),
    w (descending, as σ), c, width, zero): w is x/σ set to c = w at the smallest σ wherever x = c·σ
    to the rounding of x (where rounding alone separates them), width the number of leading σ where
    it is not, zero the flags of M = 0."""
    m, n = work.shape[-2:]
    dtype = work.dtype
    lam, v = torch.linalg.eigh(work.mT @ work if m >= n else work @ work.mT)
    lam = lam.flip(-1).clamp(min=0)  # descending, as σ²
    trace = lam.sum(-1)  # ‖M‖²_F: below max(m, n)·tiny/u, G's products underflow beyond its rounding (SVD)
    zero, small = trace == 0, trace < max(m, n) * torch.finfo(dtype).tiny / torch.finfo(dtype).eps
    s = lam.sqrt()
    x, extra = step(s)
    pos = s > 0
    w = torch.where(pos, x / torch.where(pos, s, 1), 0)
    c = w.gather(-1, (pos.sum(-1, keepdim=True) - 1).clamp(min=0))  # w at the smallest σ > 0
    w = torch.where(pos, w, c)
    differs = (x - c * s).abs() > 4 * torch.finfo(dtype).eps * x.abs().amax(-1, keepdim=True)
    w = torch.where(differs, w, c)
    width = (differs * torch.arange(1, w.shape[-1] + 1, device=w.device)).amax(-1)
    ratio = lam[:, 0] * _max_slope(w, lam) / torch.maximum(_max_slope(x, s), w.amax(-1)).clamp(min=1)
    # the SVD where step separates σ equal to the input's rounding (a tie: the SVD's own choice is
    # taken), lifts a null direction, or G underflows
    tie = (s[:, :-1] - s[:, 1:] <= 4 * unit * s[:, :1]) & (w[:, :-1] != w[:, 1:])
    ratio = torch.where((tie.any(-1) | ((x > 0) & (s == 0)).any(-1) | small) & ~zero, math.inf, ratio)
    return x, extra, torch.where(ratio.isnan(), math.inf, ratio), (v, w, c, width, zero)


def _gram_compose(mats: torch.Tensor, x: torch.Tensor, frame: tuple, rows: list, width: list, zero: list):
    """X = M·V·Diag(w)·Vᵀ (V·Diag(w)·Vᵀ·M when wide) for the matrices ``rows`` of the batch, the others
    left unset, in ``mats``' dtype. Where it takes fewer multiply-adds (4pqK against 2q³ + 2pq², q the
    small side), as c·M + (M·V_K)·Diag(w_K − c)·V_Kᵀ over the K leading directions where w ≠ c (the
    clipped σ, the kept rank, none for a Frobenius projection): K is the matrix's ``width`` rounded up
    to a multiple of 8 and the matrices are grouped by it, so that each result depends on its own
    matrix only (distributed owners compute bit for bit what one process does). M = 0: the identity
    frame, x on the diagonal."""
    p, q = max(mats.shape[-2:]), min(mats.shape[-2:])
    groups: dict[int, list[int]] = {}
    for i in rows:
        k = -(-width[i] // 8) * 8  # a multiple of 8 (k = 1 would take another kernel for a batch of one)
        groups.setdefault(k if 2 * p * k < q * q + p * q else q, []).append(i)
    if list(groups.values()) == [list(range(len(mats)))]:
        return _gram_product(mats, x, frame, next(iter(groups)), zero)
    out = torch.empty(mats.shape, dtype=mats.dtype, device=mats.device)
    for k, group in groups.items():
        idx = torch.tensor(group, device=mats.device, dtype=torch.long)
        out[idx] = _gram_product(mats[idx], x[idx], tuple(f[idx] for f in frame), k, [zero[i] for i in group])
    return out


def _gram_product(mats: torch.Tensor, x: torch.Tensor, frame: tuple, k: int, zero: list) -> torch.Tensor:
    """:func:`_gram_compose` for one group: the low-rank form over the k leading directions (k < q),
    else the frame V·Diag(w)·Vᵀ."""
    v, w, c = frame[:3]
    m, n = mats.shape[-2:]
    q = min(m, n)
    if k < q:
        vk = v[..., q - k:]  # eigh's ascending order: the k largest σ last
        dk = (w[:, :k] - c).flip(-1)[:, None, :]
        out = mats * c[:, :, None]
        if k:
            out.baddbmm_((mats @ vk) * dk, vk.mT) if m >= n else out.baddbmm_(vk * dk, vk.mT @ mats)
    else:
        f = (v * w.flip(-1)[:, None, :]) @ v.mT
        out = mats @ f if m >= n else f @ mats
    if any(zero):
        diagonal = torch.eye(m, n, dtype=mats.dtype, device=mats.device) * torch.nn.functional.pad(x, (0, n - q))[:, None, :]
        out = torch.where(torch.tensor(zero, dtype=torch.bool, device=mats.device)[:, None, None], diagonal, out)
    return out


def _max_slope(f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """max_k |f_k − f_{k+1}| / |x_k − x_{k+1}| per row (0 where f does not change; ∞ where it
    jumps between equal x)."""
    df, dx = (f[:, :-1] - f[:, 1:]).abs(), (x[:, :-1] - x[:, 1:]).abs()
    slope = torch.where(df == 0, 0, df / dx)
    return torch.cat([slope, slope.new_zeros(len(slope), 1)], -1).amax(-1)


# ---------------------------------------------------------------- polar factor (SVD-free)


def polar(m: torch.Tensor, steps: int | None = None, *, scale: torch.Tensor | None = None, floor: float | None = None,
          gram: torch.Tensor | None = None, top: float | None = None) -> torch.Tensor:
    """Polar factor U·Vᵀ of a batch of matrices (..., m, n) by the cubic Newton–Schulz iteration
    X ← 1.5X − 0.5·X(XᵀX), which converges to the polar factor for σ(X) ∈ (0, √3) (zero singular
    values stay zero: a partial isometry for rank-deficient input). Batched matmuls in float32
    (float64 for float64 input), on the smaller Gram side.

    ``scale`` (broadcastable to (..., 1, 1)) normalizes the input, default ‖M‖_F (then σ ≤ 1).
    ``steps`` defaults to the count that lifts a normalized singular value ``floor`` (default
    2⁻²⁰ in fp32, 2⁻⁴⁰ in fp64) to 1 within the dtype's precision (:func:`polar_steps`).
    ``gram``: MᵀM (tall) or MMᵀ (wide) in the working dtype, when the caller has it (saves the
    first step's product).

    ``top``: the caller guarantees σ(M)/scale ≤ top and every singular value that matters is
    ≥ ``floor``·scale. Then each step is the scaled one, X ← f(αX) with f(x) = 1.5x − 0.5x³ and
    α = √(3/(1 + ℓ + ℓ²)) for the current lower end ℓ (the interval [ℓ, 1] maps onto [f(αℓ), 1],
    both ends equal: Chen & Chow's scaled Newton–Schulz), with α capped so that f(α) ≥ 1/2
    (numerical safety), which lifts ℓ by about 2.3 per step instead of 1.5: about half the steps
    from a small floor (:func:`scaled_polar_schedule`).
    ``steps`` is then ignored.
    """
    dtype = _work_dtype(m)
    x = m.to(dtype)
    tall = x.shape[-2] >= x.shape[-1]
    if not tall:
        x = x.transpose(-2, -1)
    if scale is None:
        scale = torch.linalg.matrix_norm(x).unsqueeze(-1).unsqueeze(-1)
    scale = scale.to(dtype).clamp(min=torch.finfo(dtype).tiny)
    if top is not None:
        scale = scale * top  # σ/scale ≤ 1 from here on
    x = x / scale
    low = floor if floor is not None else (2.0**-40 if dtype == torch.float64 else 2.0**-20)
    if top is not None:
        alphas = scaled_polar_schedule(low / top, dtype)
    else:
        alphas = [1.0] * (polar_steps(low, dtype) if steps is None else steps)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    if gram is not None:
        gram = (gram / (scale * scale)).reshape(-1, *gram.shape[-2:])
    for a in alphas:
        xtx = x.transpose(-2, -1) @ x if gram is None else gram
        gram = None
        x = torch.baddbmm(x, x, xtx, beta=1.5 * a, alpha=-0.5 * a**3)  # f(αX) = 1.5αX − 0.5α³·X(XᵀX), one pass
    x = x.reshape(*lead, *x.shape[-2:])
    return x if tall else x.transpose(-2, -1)


def scaled_polar_schedule(floor: float, dtype: torch.dtype) -> list[float]:
    """The α of each scaled Newton–Schulz step (see :func:`polar`) that brings every normalized
    singular value in [floor, 1] to within the dtype's precision of 1, then one plain step
    (α = 1) to settle rounding; simulated on the host (no device syncs)."""
    eps = torch.finfo(dtype).eps
    low, alphas = floor, []
    while 1 - low > eps and len(alphas) < 200:
        a = min(math.sqrt(3 / (1 + low + low * low)), _ALPHA_CAP)
        alphas.append(a)
        low = min(1.5 * a * low - 0.5 * (a * low) ** 3, 1.5 * a - 0.5 * a**3)
    return alphas + [1.0]


# α with f(α) = 1/2: the top of the spectrum never drops below 1/2, so no singular direction passes
# through magnitudes where rounding (~ε·‖X‖) would swamp it (full equioscillation, α → √3 for a
# small floor, maps σ = 1 to f(√3) = 0 and costs ~1e-11 in fp64).
_ALPHA_CAP = 1.5320888862379562


def polar_steps(floor: float, dtype: torch.dtype, top: float = 1.0) -> int:
    """Cubic Newton–Schulz steps that bring every normalized singular value in [floor, top]
    (top < √3) to within the dtype's precision of 1, simulated on the host (no device syncs)."""
    eps = torch.finfo(dtype).eps
    worst = 0
    for x in (floor, top):
        n = 0
        while abs(1 - x) > eps and n < 200:
            x = 1.5 * x - 0.5 * x**3
            n += 1
        worst = max(worst, n)
    return worst + 1


def _gershgorin(g: torch.Tensor) -> torch.Tensor:
    """max_i Σ_j |G_ij| per matrix of a batch: an upper bound on ‖G‖₂ for symmetric G."""
    return g.abs().sum(-1).amax(-1)


def _spectral_norm_estimate(e: torch.Tensor, iters: int = 12) -> torch.Tensor:
    """Lower estimate of σ_max(E) by power iteration on the small Gram matrix (one matmul over E,
    then q×q products: E is read once, not twice per iteration) from a fixed generic start (no
    SVD)."""
    small = e.transpose(-2, -1) @ e if e.shape[-2] >= e.shape[-1] else e @ e.transpose(-2, -1)
    n = small.shape[-1]
    v = 1 + torch.arange(n, dtype=e.dtype, device=e.device) / (n + 1) * 0.7  # deterministic, generic
    v = v.expand(e.shape[0], n).unsqueeze(-1)
    for _ in range(iters):
        w = small @ v
        v = w / torch.linalg.vector_norm(w, dim=-2, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)
    return (v.transpose(-2, -1) @ small @ v).reshape(e.shape[0]).clamp(min=0).sqrt()


# ---------------------------------------------------------------- euclidean, isotropic: P_C(Y)


@backward_op
def euclidean_projection(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """X⁺ = P_C(Y), the Euclidean projection (paper Example 2.6: an isotropic φ = h∘‖·‖ is an
    increasing function of the distance, so the prox of an indicator is P_C; for euclidean φ it
    is the definition). Spectral sets act on the (shape[0], rest) matrix (per matrix of a
    ``view``). Isotropic: infeasible where ‖P_C(Y) − Y‖_F > t (C misses Y + t·dom φ₁); then P_C(Y) is
    also the fallback, so only the flag differs."""
    kind = constraint["kind"]
    if kind in SPECTRAL_SETS:
        mats = _matrices(y, batch_dims)
        x, _ = _spectral_map(mats, lambda s: (_sigma_proj(kind, s, constraint), None))
        x = _unflat(x, y)
    else:
        x = _unflat(_VECTOR_PROJ[kind](_flat(y, batch_dims), constraint), y)
    if geometry["kind"] == "euclidean" or not ref.bounded:
        return x, None
    diff = _flat(x, batch_dims) - _flat(y, batch_dims)
    scale = _norm(_flat(y, batch_dims))
    return x, _per_element(_too_far(_norm(diff), t, scale, y), y, batch_dims)


# ---------------------------------------------------------------- anisotropic (Table 1, first half)


@backward_op
def anisotropic_separable(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Sets whose anisotropic prox is P_C(Y) for every even h increasing in |u| (paper Table 1):
    sign_set(r) → r·sign(Y) (sign(0) := +1); linf_ball(r) → clip(Y, −r, r); linf_sphere(r) → clip
    if ‖Y‖∞ ≥ r, else the first max-magnitude entry moves to sign(y_j)·r (Appendix A.2);
    l0(k) → keep the k largest |y_i| (H_k; earliest index among ties). Each coordinate moves as
    little as the set allows, which also minimizes ‖X − Y‖∞: infeasible where that exceeds t."""
    v = _flat(y, batch_dims)
    x = _VECTOR_PROJ[constraint["kind"]](v, constraint)
    if not ref.bounded:
        return _unflat(x, y), None
    bad = _too_far((x - v).abs().amax(-1), t, v.abs().amax(-1), y)
    return _unflat(x, y), _per_element(bad, y, batch_dims)


@backward_op
def anisotropic_l2_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """ℓ2 (Frobenius) ball under φ₁ = Σh(x_i) (paper Appendix A.1): Y if ‖Y‖ ≤ r, else
    x_i = sign(y_i)·s_i with s_i + t(h*)'(ν s_i) = |y_i| and ν ≥ 0 found by bisection so that
    ‖x‖ = r. Log barrier: closed-form root; power barrier: safeguarded Newton; indicator: the κ → ∞
    limit s_i = max(|y_i|/(1+τ), |y_i| − t); quadratic: the Euclidean projection."""
    v = _flat(y, batch_dims)
    s, bad = _ball_magnitudes(v.abs(), t, constraint["radius"], ref, y.dtype)
    x = _unflat(torch.sign(v) * s, y)
    return x, None if bad is None else _per_element(bad, y, batch_dims)


@backward_op
def anisotropic_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius (ℓ2) sphere under φ₁ = Σh(x_i) (paper Theorem 3.5 with Appendix A.1): the ball step if ‖Y‖ ≥ r, else
    the outward step sign(x_i) = sign(y_i), |x_i| = s_i ≥ |y_i| with s_i − t(h*)'(ν s_i) = |y_i|
    (log barrier: νs² + (1 − νt − νa)s − a = 0; a = 0: s = max(0, t − 1/ν)), ν by bisection.
    Feasible iff Σ(|y_i| + t)² ≥ r²; at Y = 0 the result is (r/√n)·1."""
    v = _flat(y, batch_dims)
    s, bad = _sphere_magnitudes(v.abs(), t, constraint["radius"], ref, y.dtype)
    x = _unflat(_sign(v) * s, y)
    return x, None if bad is None else _per_element(bad, y, batch_dims)


# ---------------------------------------------------------------- spectral (Table 1, second half)


@backward_op
def spectral_projection(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Orthogonally invariant sets whose spectral prox is P_C(Y) for every h (Theorem 3.5 reduces
    to the separable step on σ(Y), whose solution is h-independent; Table 1):
    stiefel(r) → r·U Vᵀ (reduced SVD, wide or tall; zero σ use LAPACK's completions; Y = 0 →
    r·I_{m×n}); spectral_ball(r) → U·Diag(min(σ_i, r))·Vᵀ; spectral_sphere(r) → the linf_sphere
    step on σ (Appendix A.2); rank(k) → U·Diag(H_k(σ))·Vᵀ. ``method: polar`` (stiefel,
    spectral_ball) is SVD-free and approximate: :func:`_stiefel_polar`, :func:`_spectral_ball_polar`;
    ``auto`` picks one by device and size (:func:`geomopt.geometry.method.resolve_method`).
    Infeasible where max_i |x_i − σ_i| > t (the spectral distance from Y to C)."""
    kind = constraint["kind"]
    if method_choice.resolve_method(constraint, y.device, y.shape[batch_dims:]) == "polar":
        return _POLAR[kind](y, t, ref, constraint, geometry=geometry, batch_dims=batch_dims)

    def step(s):
        sx = _sigma_proj(kind, s, constraint)
        return sx, _too_far((sx - s).abs().amax(-1), t, s.amax(-1), y) if ref.bounded else None

    x, bad = _spectral_map(_matrices(y, batch_dims), step)
    return _unflat(x, y), None if bad is None else _element_any(bad, y, batch_dims)


@backward_op
def spectral_frobenius_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius ball under φ₁ = Σh(σ_i) (Theorem 3.5 with Appendix A.1): the anisotropic ℓ2-ball
    step on σ(Y), then X⁺ = U·Diag(x)·Vᵀ."""
    x, bad = _spectral_map(_matrices(y, batch_dims),
                           lambda s: _ball_magnitudes(s, t, constraint["radius"], ref, y.dtype))
    return _unflat(x, y), None if bad is None else _element_any(bad, y, batch_dims)


@backward_op
def spectral_frobenius_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius sphere under φ₁ = Σh(σ_i) (Theorem 3.5): the anisotropic sphere step on σ(Y)
    (outward steps may lift zero singular values: LAPACK's completions give their vectors), then
    U·Diag(x)·Vᵀ. Y = 0 → (r/√q)·I_{m×n}."""
    x, bad = _spectral_map(_matrices(y, batch_dims),
                           lambda s: _sphere_magnitudes(s, t, constraint["radius"], ref, y.dtype))
    return _unflat(x, y), None if bad is None else _element_any(bad, y, batch_dims)


def _stiefel_polar(y, t, ref, constraint, *, geometry, batch_dims):
    """SVD-free Stiefel step r·polar(Y): normalize by c = max(r + t, √(max_i Σ_j |G_ij|)/1.5), G
    the small Gram matrix — when X ∈ Stiefel(r), σ(Y) ∈ (r − t, r + t), and the second term (a
    Gershgorin bound on σ_max²) keeps σ/c ≤ 1.5 < √3 (convergence) for any Y — then iterate for
    the host-computed number of steps that lifts the smallest feasible σ/c to 1 in the working
    precision: cubic Newton–Schulz on Y (scaled, :func:`polar`) or Y·G^{−1/2} by the Gram
    matrix's inverse square root, whichever costs fewer FLOPs (:func:`_polar_by_cost`). Measured against the SVD on Y = X − tW,
    X ∈ Stiefel(r), ‖W‖₂ ≤ 0.99, t ∈ {0.3, 0.02, 0.001}·r (48×24, 24×48, 256×128, 128×512):
    tests/test_backward.py asserts max-entry error ≤ 2e-6·r (fp32), ≤ 1e-13·r (fp64). The step
    count is the feasible case's (4 steps for t = 0.02r): Y far from Stiefel(r) — not a step from
    a feasible X — is flagged and left less converged (8e-2·r for a Gaussian 64×32 Y); in training
    the next step brings X back to ~3e-7 (tests/test_optimizer.py). Use ``method: exact`` for
    arbitrary Y. The flag uses a power-iteration estimate of ‖Y − X⁺‖₂ (a lower bound: marginal
    infeasibility can go unflagged)."""
    r = constraint["radius"]
    mats = _matrices(y, batch_dims)
    q = min(mats.shape[-2:])
    fro = torch.linalg.matrix_norm(mats)
    # Gershgorin on the small Gram G: σ_max² ≤ max_i Σ_j |G_ij| ≤ √q·σ_max², so c ≥ σ_max/1.5
    # for any Y, and c ≤ (r + t)·max(1, q^¼/1.5) when σ ≤ r + t (‖Y‖_F/1.5 would give √q/1.5)
    gram = mats.mT @ mats if mats.shape[-2] >= mats.shape[-1] else mats @ mats.mT  # mats: working dtype
    c = torch.clamp(_gershgorin(gram).sqrt() / 1.5, min=r + t)[:, None, None]
    # Feasible case: σ ∈ [lo, hi] (t widened by 1.2: Newton–Schulz forwards reach ‖W‖₂ ≈ 1.13).
    # The Gram rows of such a Y sum to at most r² + √q(2r·t' + t'²): where that keeps the guard
    # below r + t, c = r + t exactly and σ/c ∈ [lo, hi]/(r + t) (a few steps for small t);
    # otherwise c ≤ hi·q^¼/1.5 and σ/c ≤ 1.5.
    t1 = 1.2 * t
    lo, hi = r - t1, r + t1
    if lo <= 0:
        floor, top = 2.0 ** (-40 if mats.dtype == torch.float64 else -20), 1.5
    elif math.sqrt(r * r + math.sqrt(q) * (2 * r * t1 + t1 * t1)) <= 1.5 * (r + t):
        floor, top = lo / (r + t), hi / (r + t)
    else:
        floor, top = lo / max(r + t, hi * q ** 0.25 / 1.5), 1.5
    qf = _polar_by_cost(mats, gram, c, floor, top)
    zero = (fro == 0)[:, None, None]
    eye = torch.eye(mats.shape[-2], mats.shape[-1], dtype=mats.dtype, device=mats.device)
    xm = torch.where(zero, eye, qf).mul_(r)
    x = _unflat(xm, y)
    if not ref.bounded:
        return x, None
    dist = _spectral_norm_estimate(mats - xm)
    return x, _element_any(_too_far(dist, t, fro, y), y, batch_dims)


def _polar_by_cost(mats: torch.Tensor, gram: torch.Tensor, c: torch.Tensor, floor: float, top: float) -> torch.Tensor:
    """polar(M) for σ(M)/c ∈ [floor, top] by the cheaper of two iterations, counted in matmul
    FLOPs on the host: scaled cubic Newton–Schulz on M itself (:func:`polar`, 2mn² per step), or
    M·G^{−1/2} with the coupled Newton–Schulz inverse square root of the small Gram matrix
    (:func:`_inverse_sqrt` on G/c², spectrum in [floor², top²]: 3n³ per step, then one mn²
    product; n the small side). The second wins for elongated matrices near Stiefel (few steps,
    n ≪ m); from a small floor the cubic schedule is far shorter."""
    m, n = max(mats.shape[-2:]), min(mats.shape[-2:])
    cubic = 2 * m * n * n * len(scaled_polar_schedule(floor / top, mats.dtype)) - m * n * n
    gram_steps = _inverse_sqrt_steps(floor * floor, _work_dtype(mats), top * top)
    if 3 * n**3 * gram_steps + m * n * n >= cubic:
        return polar(mats, scale=c, floor=floor, top=top, gram=gram)
    z = _inverse_sqrt(gram / (c * c), floor=floor * floor, top=top * top) / c
    return mats @ z if mats.shape[-2] >= mats.shape[-1] else z @ mats


def _spectral_ball_polar(y, t, ref, constraint, *, geometry, batch_dims):
    """SVD-free singular value clipping U·Diag(min(σ, r))·Vᵀ by matrix iterations on the small
    Gram matrix only.

    For tall Y (wide: transpose) with G = YᵀY = V·Diag(σ²)·Vᵀ:
        clip_r(Y) = r·Y·H^{−1/2},   H = r²I + ½(G − r²I)(I + S),   S = sign(G − r²I),
    since H = V·Diag(max(σ², r²))·Vᵀ, so r·H^{−1/2} = V·Diag(min(1, r/σ))·Vᵀ. S is the polar factor
    of the symmetric shift (:func:`polar`, scaled cubic Newton–Schulz); it is inexact only where
    |σ² − r²| is below its floor, and there H's eigenvalue lies between r² and σ², which moves
    the clipped σ by at most |σ − r|: the floor 2u·r²/c (c ≥ ‖G − r²I‖₂, Gershgorin) keeps that
    below u·r. H^{−1/2} comes from the coupled Newton–Schulz iteration (Y ← Y·T, Z ← T·Z,
    T = ½(3I − Z·Y), Y₀ = H/c_H, Z₀ = I, Z → (H/c_H)^{−1/2}), whose spectrum lies in
    [r²/c_H, 1]: a few steps near the ball, more for σ ≫ r. Directions with σ ≤ r (including
    σ = 0: rank-deficient Y) get H = r², a factor 1, exactly. Everything is n×n except the Gram
    matrix and the final product; the two step counts are set on the host from the largest scales
    in the batch (two host syncs per call). Measured against the SVD (tests/test_backward.py):
    Gaussian 40×24, 24×40 and rank-5 40×24 matrices, max-entry error ≤ 2e-6·r (fp32), ≤ 1e-13·r
    (fp64); σ spread from 100r to 0.01r: ≤ 1e-4·r (fp32), ≤ 1e-12·r (fp64). The flag uses a
    power-iteration estimate of ‖Y − X⁺‖₂."""
    r = constraint["radius"]
    mats = _matrices(y, batch_dims)
    tall = mats.shape[-2] >= mats.shape[-1]
    a = mats if tall else mats.transpose(-2, -1)
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    shifted = a.transpose(-2, -1) @ a - (r * r) * eye
    c_s = _gershgorin(shifted)  # ≥ ‖G − r²I‖₂
    tiny = torch.finfo(a.dtype).tiny
    worst = max(float(c_s.amax()) if len(c_s) else 0.0, tiny)  # host sync 1: S's step count
    sgn = polar(shifted, scale=c_s.clamp(min=tiny)[:, None, None],
                floor=min(0.5, 2 * torch.finfo(a.dtype).eps * r * r / worst), top=1.0)
    excess = 0.25 * (shifted @ (eye + sgn))
    excess = excess + excess.transpose(-2, -1)  # ½(G − r²I)(I + S), symmetrized (they commute to rounding)
    c_h = r * r + _gershgorin(excess)  # ≥ ‖H‖₂, with H − r²I ⪰ 0 small near the ball
    floor = r * r / max(float(c_h.amax()) if len(c_h) else r * r, tiny)  # host sync 2: H^{−1/2}'s step count
    z = _inverse_sqrt((excess + (r * r) * eye) / c_h[:, None, None], floor=floor)
    xa = a @ (z * (r / c_h.sqrt())[:, None, None])
    xm = xa if tall else xa.transpose(-2, -1)
    x = _unflat(xm, y)
    if not ref.bounded:
        return x, None
    dist = _spectral_norm_estimate(mats - xm)
    return x, _element_any(_too_far(dist, t, torch.linalg.matrix_norm(mats), y), y, batch_dims)


def _inverse_sqrt(h: torch.Tensor, floor: float, top: float = 1.0) -> torch.Tensor:
    """H^{−1/2} for a batch of symmetric H with spectrum in [floor, top] (top < 2.5) by the coupled
    Newton–Schulz iteration Y ← Y·T, Z ← T·Z, T = ½(3I − Z·Y) from Y = H, Z = I (Higham, Functions
    of Matrices, §6.3; stable, unlike the uncoupled form): Y → H^{1/2}, Z → H^{−1/2}. A spectral
    value μ moves as e ← ¾e² + ¼e³ with e = 1 − μ·z²; the step count is simulated on the host."""
    steps = _inverse_sqrt_steps(floor, h.dtype, top)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    t = 1.5 * eye - 0.5 * h
    ym, z = h @ t, t
    for _ in range(steps - 1):
        t = 1.5 * eye - 0.5 * (z @ ym)
        ym, z = ym @ t, t @ z
    return z


def _inverse_sqrt_steps(floor: float, dtype: torch.dtype, top: float = 1.0) -> int:
    eps = torch.finfo(dtype).eps
    worst = 1
    for mu in (floor, top):
        y, z, n = mu, 1.0, 0
        while abs(1 - y * z) > eps and n < 100:
            t = 1.5 - 0.5 * z * y
            y, z, n = y * t, t * z, n + 1
        worst = max(worst, n)
    return worst + 1


_POLAR = {"stiefel": _stiefel_polar, "spectral_ball": _spectral_ball_polar}


# ---------------------------------------------------------------- rowwise / columnwise


def _rows(y: torch.Tensor, batch_dims: int, geometry: dict) -> tuple[torch.Tensor, bool]:
    """(B, rows, len) in the working dtype, rows = the geometry's groups: rowwise → slices along
    dim 0 of the (shape[0], rest) view, columnwise → along dim 1; ``layout: in_out`` swaps them
    (the tensor is stored transposed). Returns the view and whether it was transposed."""
    shape = y.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    mats = y.to(_work_dtype(y)).reshape(math.prod(y.shape[:batch_dims]), m, -1)
    by_row = (geometry["kind"] == "rowwise") != (geometry.get("layout", "out_in") == "in_out")
    return (mats, False) if by_row else (mats.transpose(-2, -1), True)


def _from_rows(rows: torch.Tensor, transposed: bool, y: torch.Tensor) -> torch.Tensor:
    return _unflat(rows.transpose(-2, -1) if transposed else rows, y)


@backward_op
def groupwise_frobenius_ball(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius ball under φ₁ = Σ_j h(‖x_j‖) over rows (columns) x_j. For fixed row norms s_j the
    constraint depends only on s, and ‖x_j − y_j‖ ≥ |s_j − ‖y_j‖| with equality iff x_j ∥ y_j, so
    the prox is x_j = (s_j/‖y_j‖)·y_j with s the anisotropic ℓ2-ball step (Appendix A.1) on the
    vector of row norms a_j = ‖y_j‖. Zero rows stay zero."""
    rows, tr = _rows(y, batch_dims, geometry)
    a = _norm(rows)
    s, bad = _ball_magnitudes(a, t, constraint["radius"], ref, y.dtype)
    scale = torch.where(a > 0, s / a.clamp(min=torch.finfo(a.dtype).tiny), torch.zeros_like(a))
    x = _from_rows(rows * scale.unsqueeze(-1), tr, y)
    return x, None if bad is None else _per_element(bad, y, batch_dims)


@backward_op
def groupwise_frobenius_sphere(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """Frobenius sphere under the row(column)-wise isotropic φ: same reduction as the ball (row
    norms carry the constraint, each row stays on its ray), with the anisotropic sphere step on
    the row norms. A zero row that must grow takes the direction of its first entry
    (deterministic; every direction is optimal)."""
    rows, tr = _rows(y, batch_dims, geometry)
    a = _norm(rows)
    s, bad = _sphere_magnitudes(a, t, constraint["radius"], ref, y.dtype)
    e0 = torch.zeros_like(rows)
    e0[..., 0] = 1
    unit = torch.where((a > 0).unsqueeze(-1), rows / a.clamp(min=torch.finfo(a.dtype).tiny).unsqueeze(-1), e0)
    x = _from_rows(unit * s.unsqueeze(-1), tr, y)
    return x, None if bad is None else _per_element(bad, y, batch_dims)


# ---------------------------------------------------------------- proximal decay (every geometry but adam)


@backward_op
def proximal_decay(y, t, ref, constraint, *, gamma, geometry, batch_dims):
    """g = (1/λ)⋆φ: X⁺ = Y/(1 + γλ) (paper Remark 2.5; implicit radius ρ/λ). From the optimality
    condition ∇φ(λX) = ∇φ((Y − X)/γ), injectivity of ∇φ gives λX = (Y − X)/γ; it uses γ, not t.
    Defined whenever X ∈ dom g (then λY/(1+γλ) ∈ ρ·dom φ₁ by the triangle inequality), so no flag."""
    return (y.to(_work_dtype(y)) / (1 + gamma * constraint["lam"])).to(y.dtype), None
