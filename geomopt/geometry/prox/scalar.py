"""The scalar root solves of the ℓ2-ball and sphere steps, and those steps on magnitudes.

The anisotropic ball and sphere steps (paper Appendix A.1), and with them the spectral Frobenius
and groupwise rows, reduce to a vector of magnitudes a ≥ 0 (|y_i|, σ_i(Y) or row norms) and one
multiplier τ: s_i = t·σ_i(τ) with σ + c·(h₁*)'(τσ) = a_i/t (c = +1 for the ball, −1 for the
outward sphere step) and τ such that Σs² = r².

* :func:`ball_magnitudes`: the ball step; τ by a safeguarded Newton method with a fixed step
  count (:func:`_solve_ball`), started at the indicator's exact root (:func:`_box_tau`);
* :func:`sphere_magnitudes`: the sphere step (the ball step inward, the outward step otherwise);
  τ by bisection on log τ and a final interpolation (:func:`_solve_tau`);
* σ(τ) per reference: closed forms for the log barrier and the indicator, Newton for the power
  barrier (:func:`_power_sigma`, :func:`_ball_newton`, :func:`_unit_dual`).

Fixed step counts throughout: no host syncs.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, cast

import torch

from geomopt.geometry.prox.common import row_norm, ref_profile, rounding_slack
from geomopt.geometry.prox.vector import proj_l2_ball, sphere_euclid
from geomopt.geometry.reference import Reference

# ---------------------------------------------------------------- the τ solves
#
# Everything below works in units of t: α = |y_i|/t, σ = |x_i|/t, ϱ = r/t, and the multiplier
# τ = t·ν/ε (dimensionless, ε-free). Inputs are (B, n) magnitudes α ≥ 0.


def _bisection_steps(dtype: torch.dtype) -> int:
    # log τ lives in [−60 ln2, 60 ln2] (width 83). The final interpolation (:func:`_interpolate`,
    # second order in the bracket's width) recovers full precision from a bracket of 83·2⁻²⁴ ≈ 5e-6
    # (fp32) or 83·2⁻³⁶ ≈ 1e-9 (fp64). Measured against 40 / 64 halvings (brackets below 1e-10 /
    # 5e-18): the same σ to ≤ 3e-7 / ≤ 1e-15 relative over the power barrier (κ = 1, 2, 4, 16),
    # log barrier and indicator, t/r ∈ [1e-4, 20], balls and spheres; 16 / 28 halvings start to
    # lose digits (5e-7 / 1e-14), so 8 halvings of margin.
    return 36 if dtype == torch.float64 else 24


_LOG_TAU = 60 * math.log(2.0)


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
    kappa = cast(float, ref.kappa)  # the power barrier's κ, a float
    for _ in range(_NEWTON_STEPS):
        f, fp = _unit_dual(tau * s, kappa)
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
    theta = torch.where(den != 0, (target - a) / torch.where(den != 0, den, torch.ones_like(den)),
                        torch.zeros_like(den))
    theta = theta.clamp(0, 1)
    return torch.sqrt((sig_a * sig_a + theta * (sig_b * sig_b - sig_a * sig_a)).clamp(min=0))


def _newton_steps(dtype: torch.dtype, kappa: float) -> int:
    # Measured against 120 halvings in float64 (power barrier κ = 1, 1.5, 2, 3, 4, 16, 64, log
    # barrier; 3, 64 and 300 entries uniform, |Gaussian|, over four decades, two or one nonzero,
    # all equal; t/r from 1e-4 to 20; ‖a‖ from just outside r to a millionth short of infeasible):
    # float64 reaches ≤ 5e-12 relative in 8 steps; float32 the float32 conditioning of the problem
    # (as the former 24 halvings did) in 4 for κ ≥ 3 (κ = 2 needs 5, κ = 1 and the log barrier 8).
    return 4 if dtype != torch.float64 and kappa >= 3 else 8


def _solve_ball(alpha: torch.Tensor, rho2: float, ref: Reference) -> torch.Tensor:
    """σ ≥ 0 with σ_i + (h₁*)'(τσ_i) = α_i (units of t) and Σσ² = ρ², by a safeguarded Newton
    method on τ with a fixed step count (:func:`_newton_steps`; no host syncs). A ρ² past the
    largest value of α's dtype (a step t tiny against r) is +∞ there: the solve's σ are then not
    finite and the caller takes t → 0's limit, the projection (:func:`_ball_finish`).

    Start: the indicator's root (:func:`_box_tau`), exact for the indicator and a lower bound
    otherwise ((h₁*)'(u) ≤ min(u, 1) makes its σ the smallest). Each step: σ(τ) by two Newton steps
    (closed form for the log barrier), which bracket it as s ≤ σ(τ) ≤ upper (H concave, H' ≥ 1);
    the bracket [lo, hi] on τ moves where Σs² > ρ² or Σupper² < ρ² (Σσ² decreases in τ); then
    Newton on Ψ = log(Σσ² − Σσ_∞²) over log(1 + τ), σ_∞ = (α − 1)₊ the τ → ∞ limit — straight for
    the shrink σ = α/(1+τ) and for the power-law tails σ − σ_∞ ~ τ^{−κ} — with the target gap
    floored at u·ρ² (the float rounding of Σσ²). A step that leaves the bracket (beyond its
    rounding) is replaced by bisection in log τ. The result is scaled onto Σσ² = ρ² exactly."""
    if not isinstance(rho2, torch.Tensor) and rho2 > torch.finfo(alpha.dtype).max:
        rho2 = math.inf  # a Python float the dtype cannot hold is refused as an op's scalar (clamp's min)
    tau = _box_tau(alpha, rho2)
    lim = (alpha - 1).clamp_(min=0)
    s = torch.maximum(alpha / (tau + 1), lim)  # the indicator's σ
    if ref.kind == "indicator":
        return s * (rho2 / (s * s).sum(-1, keepdim=True)).sqrt()
    power = ref.kind == "power_barrier"
    eps = torch.finfo(alpha.dtype).eps
    lo, hi = tau, torch.full_like(tau, _TAU_MAX)
    kappa = cast(float, ref.kappa) if power else 1.0  # the power barrier's κ, a float
    steps = _newton_steps(alpha.dtype, kappa)
    for step in range(steps + 1):
        s, upper, rate = _ball_newton(alpha, lim, tau, s, kappa) if power else _ball_log(alpha, tau)
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
    raise AssertionError("unreachable: the last step returns")


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
    alpha, rho2 = a / t, (r / t) * (r / t)  # not ** 2: a tiny step t makes it inf, not OverflowError
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
    return _interpolate(s_lo, s_hi, torch.zeros_like(lo) + rho2) * t  # rho2 may be a 0-d tensor


# ---------------------------------------------------------------- the steps on magnitudes


def ball_magnitudes(a: torch.Tensor, t: float, r: float, ref: Reference,
                     dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Anisotropic ℓ2-ball step on magnitudes a (B, n) ≥ 0 (paper Appendix A.1):
    s = a if ‖a‖ ≤ r, else s_i = t·σ_i(τ) from σ + (h₁*)'(τσ) = a/t with τ such that Σs² = r²
    (:func:`_solve_ball`). Returns (s, infeasible) — infeasible where Σ(a_i − t)₊² > r², i.e. the
    ball misses Y + t·dom φ₁; there s is the Euclidean projection a·r/‖a‖."""
    if ref_profile(ref) == "quadratic":
        return proj_l2_ball(a, r), None
    return _ball_finish(a, _solve_ball(a / t, (r / t) * (r / t), ref) * t, t, r, dtype)


def _ball_finish(a: torch.Tensor, s: torch.Tensor, t: float, r: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ball step's magnitudes from the solve's s: a where ‖a‖ ≤ r, s landed on the ball
    exactly (a safeguard for the boundary cases inside the slack), and the Euclidean projection
    where infeasible; with the infeasibility flags."""
    slack = rounding_slack(a.amax(-1), t, dtype).unsqueeze(-1)
    bad = ((a - t - slack).clamp(min=0).square().sum(-1) > r * r)
    s = torch.where((row_norm(a) <= r).unsqueeze(-1), a, proj_l2_ball(s, r))
    bad |= ~torch.isfinite(s).all(-1)  # t so small that a/t or (r/t)² overflow: t → 0's limit, the projection
    return torch.where(bad.unsqueeze(-1), proj_l2_ball(a, r), s), bad


def sphere_magnitudes(a: torch.Tensor, t: float, r: float, ref: Reference,
                       dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Anisotropic sphere step on magnitudes (paper Appendix A.1, outward): the ball step if
    ‖a‖ ≥ r, else the outward bisection with |x_i| ≥ |y_i| (:func:`_sphere_sigma`, Σs² increasing
    in τ); infeasible where Σ(a_i + t)² < r² (outward) or the ball step is infeasible (inward)."""
    euclid = sphere_euclid(a, r)
    if ref_profile(ref) == "quadratic":
        return euclid, None
    inward = (row_norm(a) >= r).unsqueeze(-1)
    # one solve for both kinds of rows (:func:`_signed_sigma`)
    s = _solve_tau(functools.partial(_signed_sigma, inward=inward), a, t, r, ref, decreasing=inward)
    s_in, bad_in = _ball_finish(a, s, t, r, dtype)
    slack = rounding_slack(a.amax(-1), t, dtype).unsqueeze(-1)
    bad_out = (a + t + slack).square().sum(-1) < r * r
    s_out = s * (r / row_norm(s).clamp(min=torch.finfo(a.dtype).tiny)).unsqueeze(-1)
    s = torch.where(inward, s_in, s_out)
    bad = torch.where(inward.squeeze(-1), bad_in, bad_out) | ~torch.isfinite(s).all(-1)  # as in _ball_finish
    return torch.where(bad.unsqueeze(-1), euclid, s), bad
