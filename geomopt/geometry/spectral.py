"""Spectral approximations of ∇φ*(D) = U·Diag((h*)'(σ_i))·Vᵀ (paper Corollary 3.2, Example 3.3).

Every approximation is a function of a ``(..., m, n)`` tensor (leading dims are independent
matrices) and a reference :class:`~geomopt.geometry.reference.Reference`, registered under its
``approx.kind`` in :data:`APPROX_OPS`:

    svd            exact for any h: reduced SVD, U·Diag((h*)'(σ))·Vᵀ
    gram_eigh      exact in float64: eigh of the smaller Gram matrix
    newton_schulz       Muon's quintic iteration; realizes its own map, ignores the reference
    gram_newton_schulz  the same map iterated on the small Gram side (restarted, Dao AI Lab 2026)
    polar_express       per-step quintics (Amsel et al. 2025); realizes its own map, ignores the reference

Pre-normalization (geometry field ``prenormalize``) is applied by every approximation in the same
way, per matrix (norms over the last two dims): ``frobenius`` D/(‖D‖_F + ε), ``max``
D/max(‖D‖_F, ε) (torch.optim.Muon), ``aol`` S·D (Turbo-Muon's row rescaling from the smaller Gram
matrix; the polynomial iterations only), ``none``. ``None`` means the default: frobenius with ε = 1e-7
for newton_schulz / gram_newton_schulz / polar_express (they diverge without it), none for svd /
gram_eigh.

Newton–Schulz and Polar Express are *not* the ε → 0 limit (the matrix sign): the paper models them
(Remark 3.4, Appendix F, Theorem 4.7) as the spectral κ = 4 power barrier with ε ≈ 1/∏aᵢ, the
inverse slope at 0 of the composed polynomial; :func:`~geomopt.support.realized_reference` gives it.

Realized ε (κ = 4) per list and step count, as :func:`~geomopt.support.realized_reference` computes them:

    list                      5 steps   6 steps   7 steps   8 steps
    polar_express (1.01)      0.00102   0.000547  0.000295  0.000157
    speedrun (modded-nanogpt) 0.00101   0.000431  0.000184  7.82e-05
    newton_schulz (Muon)      0.00206   0.000599  0.000174  5.05e-05

(gram_newton_schulz realizes newton_schulz's: it is the same map.)

The parts the approximations share have their own modules: the working dtype
in :mod:`geomopt.geometry.dtypes`, pre-normalization in :mod:`geomopt.geometry.prenorm`, the
polynomial iterations (and the device forms of :func:`muon_order`) in
:mod:`geomopt.geometry.polynomial`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from geomopt.geometry.capture import refuse_in_capture
from geomopt.geometry.dtypes import compute_dtype
from geomopt.geometry.matrix import finite_or_zero
from geomopt.geometry.polynomial import gram_quintic_iteration, odd_quintic_iteration
from geomopt.geometry.prenorm import default_prenormalize, prenormalize
from geomopt.geometry.reference import Reference
from geomopt.registry import Registry
# the coefficient lists and what they realize are plain data (lint reads them without torch)
from geomopt.support import newton_schulz_coefficients, polar_express_coefficients
from geomopt.spec.geometries import Approx, Prenormalize

# ---------------------------------------------------------------- the working copy


def _working(x: torch.Tensor, kind: str, dtype: str) -> torch.Tensor:
    """x, a (..., m, n) tensor, in the approximation's working dtype (:func:`compute_dtype`)."""
    if x.ndim < 2:
        raise ValueError(f"{kind}: expected a (..., m, n) tensor, got shape {tuple(x.shape)}")
    return x.to(compute_dtype(x, kind, dtype))


def _prepare(x: torch.Tensor, kind: str, dtype: str, prenorm: Prenormalize | None) -> torch.Tensor:
    # Cast first, then normalize in the working dtype (as torch.optim.Muon does in bf16), in place
    # on the cast copy
    work = _working(x, kind, dtype)
    return prenormalize(work, prenorm, kind, inplace=work is not x)


# ---------------------------------------------------------------- the approximations

#: approx kind → ``fn(x, ref, *, prenormalize, dtype, scale, out_dtype, **options)``; meta ``folds``:
#: it runs :func:`~geomopt.geometry.polynomial.odd_quintic_iteration`, whose folded form can leave
#: its last product to the caller (:func:`~geomopt.geometry.polynomial.folded`'s ``last``)
APPROX_OPS = Registry("spectral approx")


def _rank_tol(sigma_max: torch.Tensor, m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # LAPACK's numerical-rank tolerance (as torch.linalg.matrix_rank): singular values below it are
    # rounding noise of a zero, and are mapped to (h*)'(0) = 0 rather than to (h*)'(noise).
    return max(m, n) * torch.finfo(dtype).eps * sigma_max


@APPROX_OPS.register("svd")
def svd(x: torch.Tensor, ref: Reference, *, prenormalize: Prenormalize | None = None, dtype: str = "auto",
        scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact ∇φ*(D) = U·Diag((h*)'(σ))·Vᵀ from the reduced SVD (paper Corollary 3.2; reduced
    suffices because (h*)'(0) = 0, Example 3.3). σ below the numerical-rank tolerance
    max(m, n)·u·σ_max count as 0. ``scale`` multiplies the mapped σ (free), the result is in
    ``out_dtype`` (default: x's), as for every approximation. A matrix holding a NaN or ±∞ maps
    to NaN (LAPACK would raise: :func:`~geomopt.geometry.matrix.finite_or_zero`)."""
    refuse_in_capture("torch.linalg.svd")
    work, nonfinite = finite_or_zero(_prepare(x, "svd", dtype, prenormalize))
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    m, n = work.shape[-2:]
    tol = _rank_tol(s[..., :1], m, n, work.dtype)
    mapped = torch.where(s > tol, ref.dual_grad(s) * scale, torch.zeros_like(s))
    return torch.where(nonfinite, math.nan, (u * mapped.unsqueeze(-2)) @ vh).to(out_dtype or x.dtype)


@APPROX_OPS.register("gram_eigh")
def gram_eigh(x: torch.Tensor, ref: Reference, *, prenormalize: Prenormalize | None = None, dtype: str = "auto",
              scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """∇φ*(D) from the smaller Gram matrix: for m ≤ n, DDᵀ = QΛQᵀ, σ = √λ and
    ∇φ*(D) = Q·Diag((h*)'(σ)/σ)·QᵀD (the isotropic factor, finite at σ = 0, so D's columns are never
    divided by σ); tall matrices use DᵀD. Exact in float64 (the default): the Gram matrix resolves
    σ only down to √(max(m,n)·u)·σ_max ≈ 1.5e-8·√max(m,n)·σ_max, and smaller σ are treated as 0
    (mapped to (h*)'(0) = 0; the component of D along them is below rounding anyway). A matrix
    holding a NaN or ±∞ maps to NaN, as in :func:`svd`."""
    refuse_in_capture("torch.linalg.eigh")
    work, nonfinite = finite_or_zero(_prepare(x, "gram_eigh", dtype, prenormalize))
    m, n = work.shape[-2:]
    # each matrix scaled by a power of two c near its largest entry (exact): the Gram matrix of
    # the scaled a neither overflows (entries past √max, 1.8e19 in float32) nor underflows, and
    # σ = c·σ' with σ' = √λ of the scaled Gram matrix
    c = _pow2_scale(work)
    a = work / c
    a = a if m <= n else a.mT
    lam, q = torch.linalg.eigh(a @ a.mT)
    sigma = lam.clamp(min=0).sqrt()
    tol = math.sqrt(max(m, n) * torch.finfo(work.dtype).eps) * sigma[..., -1:]
    # (h*)'(σ)/σ·D = [(h*)'(c·σ')/σ']·a: (h*)' is bounded (barriers, indicator) or σ (quadratic),
    # so the factor stays finite where 1/σ would not (σ near the dtype's smallest numbers)
    big = torch.finfo(sigma.dtype).max  # σ past it (a norm past the dtype's range) maps as σ = max
    mapped = ref.dual_grad((sigma * c[..., 0]).clamp(max=big)) * scale
    factor = torch.where(sigma > tol, mapped / torch.where(sigma > tol, sigma, 1), torch.zeros_like(sigma))
    out = (q * factor.unsqueeze(-2)) @ (q.mT @ a)
    return torch.where(nonfinite, math.nan, out if m <= n else out.mT).to(out_dtype or x.dtype)


def _pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """Per matrix of ``x`` (..., m, n), shape (..., 1, 1): the power of two c ≤ max|x| < 2c (1 for
    a zero matrix; representable: at most the dtype's max), so x / c is exact (but for entries it
    takes below the dtype's smallest normal number) and its entries are below 2."""
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    _, e = torch.frexp(torch.where(amax > 0, amax, 1))  # amax = f·2^e, f ∈ [½, 1)
    return torch.ldexp(torch.ones_like(amax), e - 1)


def _polynomial(x, kind, coeffs, dtype, prenorm, scale, out_dtype) -> torch.Tensor:
    work = _working(x, kind, dtype)
    cfg = default_prenormalize(kind) if prenorm is None else prenorm
    return odd_quintic_iteration(work, coeffs, prenorm=cfg, overwrite=work is not x, scale=scale,
                                 out_dtype=out_dtype or x.dtype)


@APPROX_OPS.register("newton_schulz", folds=True)
def newton_schulz(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    prenormalize: Prenormalize | None = None,
    dtype: str = "auto",
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quintic Newton–Schulz on the pre-normalized D (Muon; default triple
    (3.4445, −4.7750, 2.0315), one triple reused or one per step, or a named set of
    :data:`~geomopt.support.NEWTON_SCHULZ_SETS`). Realizes its own map,
    ≈ the κ = 4 power barrier of :func:`~geomopt.support.realized_reference`; ``ref`` is ignored."""
    coeffs = newton_schulz_coefficients(steps, coefficients)
    return _polynomial(x, "newton_schulz", coeffs, dtype, prenormalize, scale, out_dtype)


@APPROX_OPS.register("gram_newton_schulz")
def gram_newton_schulz(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    restarts: Sequence[int] = (2,),
    prenormalize: Prenormalize | None = None,
    dtype: str = "auto",
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`newton_schulz`'s map (the same ``steps`` and ``coefficients``, the same
    pre-normalization default and working dtype) computed by :func:`gram_quintic_iteration`:
    iterations on the small Gram side, X formed after each step in ``restarts`` (default: after
    step 2) and at the end. Fewer FLOPs where m ≪ n. ``ref`` is ignored."""
    coeffs = newton_schulz_coefficients(steps, coefficients)
    work = _working(x, "gram_newton_schulz", dtype)
    cfg = default_prenormalize("gram_newton_schulz") if prenormalize is None else prenormalize
    return gram_quintic_iteration(work, coeffs, prenorm=cfg, restarts=restarts, scale=scale,
                                  out_dtype=out_dtype or x.dtype)


@APPROX_OPS.register("polar_express", folds=True)
def polar_express(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    prenormalize: Prenormalize | None = None,
    dtype: str = "auto",
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Polar Express (Amsel et al. 2025): one optimal odd quintic per step from
    :func:`polar_express_coefficients` (``polar_express``: the authors' list with the 1.01 safety
    factor; ``speedrun``: modded-nanogpt's 5-step list; or user triples; the last repeats).
    Realizes its own map (paper Appendix F, Theorem 4.7); ``ref`` is ignored."""
    coeffs = polar_express_coefficients(steps, coefficients)
    return _polynomial(x, "polar_express", coeffs, dtype, prenormalize, scale, out_dtype)


def apply_approx(x: torch.Tensor, ref: Reference | None, approx: Approx | None,
                 prenorm: Prenormalize | None = None, *, scale: float = 1.0,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run a spec ``approx`` (None: svd) on ``x`` (..., m, n): ``scale``·∇φ*(x) in ``out_dtype``
    (default: x's), the scale folded into the approximation; the model's fields other than its
    ``kind`` are the approximation's options."""
    kind = "svd" if approx is None else approx.kind
    if kind not in APPROX_OPS:
        raise ValueError(f"unknown spectral approx {kind!r}; expected one of {', '.join(APPROX_OPS)}")
    if ref is None and kind in ("svd", "gram_eigh"):
        raise ValueError(f"approx {kind!r} needs a reference function")
    options = {} if approx is None else {k: v for k, v in approx.__dict__.items() if k != "kind"}
    return APPROX_OPS[kind](x, ref, prenormalize=prenorm, scale=scale, out_dtype=out_dtype, **options)
