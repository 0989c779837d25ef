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
D/max(‖D‖_F, ε) (torch.optim.Muon), ``none``. ``None`` means the default: frobenius with ε = 1e-7
for newton_schulz / gram_newton_schulz / polar_express (they diverge without it), none for svd /
gram_eigh.

Newton–Schulz and Polar Express are *not* the ε → 0 limit (the matrix sign): the paper models them
(Remark 3.4, Appendix F, Theorem 4.7) as the spectral κ = 4 power barrier with ε ≈ 1/∏aᵢ, the
inverse slope at 0 of the composed polynomial; :func:`realized_reference` gives it.

Realized ε (κ = 4) per list and step count, as :func:`realized_reference` computes them:

    list                      5 steps   6 steps   7 steps   8 steps
    polar_express (1.01)      0.00102   0.000547  0.000295  0.000157
    speedrun (modded-nanogpt) 0.00101   0.000431  0.000184  7.82e-05
    newton_schulz (Muon)      0.00206   0.000599  0.000174  5.05e-05

(gram_newton_schulz realizes newton_schulz's: it is the same map.)
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from geomopt.geometry.matrix import working_dtype
from geomopt.geometry.reference import Reference
from geomopt.registry import Registry
from geomopt.spec.model import POLYNOMIAL_APPROX_KINDS

# The coefficient lists and what they realize are plain data (lint reads them without torch).
from geomopt.catalog import (  # noqa: F401  (re-exported)
    COEFFICIENT_LISTS,
    MUON_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    SPEEDRUN_COEFFICIENTS,
    Triple,
    approx_coefficients,
    newton_schulz_coefficients,
    polar_express_coefficients,
    realized_reference,
)


def compose_polynomials(coefficients: Sequence[Triple], sigma: torch.Tensor) -> torch.Tensor:
    """The scalar map the iteration applies to each singular value: p_k ∘ … ∘ p_1(σ),
    p_i(x) = aᵢx + bᵢx³ + cᵢx⁵ (an odd polynomial, so the matrix iteration acts on σ alone)."""
    x = sigma
    for a, b, c in coefficients:
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x


# ---------------------------------------------------------------- dtype and pre-normalization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

# the approximations that are matrix polynomial iterations (realize their own map, run in bf16 on
# CUDA, pre-normalize by default), as opposed to the exact factorizations svd and gram_eigh
POLYNOMIAL_APPROXES = POLYNOMIAL_APPROX_KINDS


def compute_dtype(x: torch.Tensor, kind: str, dtype: str = "auto") -> torch.dtype:
    """Working dtype of an approximation. ``auto``: float64 for gram_eigh (the Gram matrix squares
    the condition number, so fp32 would lose √u·σ_max ≈ 3e-4·σ_max); bf16 matmuls on CUDA for
    newton_schulz / polar_express (their polynomials are insensitive to it, as in Muon); otherwise
    at least float32. Factorizations (svd, eigh) have no bf16 kernels: bf16 requests run in fp32."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
        out = _DTYPES[dtype]
        if kind in ("svd", "gram_eigh") and out == torch.bfloat16:
            out = torch.float32
        return out
    if kind == "gram_eigh":
        return torch.float64
    if kind in POLYNOMIAL_APPROXES and x.is_cuda:
        return torch.bfloat16
    return working_dtype(x.dtype)


class BF16Warning(UserWarning):
    """bf16 matrix iterations requested where bf16 matmuls are slow (a CPU without native bf16)."""


@functools.lru_cache(maxsize=None)
def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16, AMX, or what oneDNN
    counts as bf16-capable); without it a bf16 matmul is emulated: on an AVX2-only CPU it ran at
    1.2 GFLOP/s against 119 GFLOP/s in fp32 (benchmarks/dtype.py). Unknown counts as native."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
                    or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def slow_bf16(approx: dict | None, device) -> bool:
    """A polynomial iteration asked to run in bf16 on a CPU without native bf16 matmuls."""
    approx = approx or {}
    return (approx.get("kind") in POLYNOMIAL_APPROXES and approx.get("dtype") == "bfloat16"
            and torch.device(device).type == "cpu" and not native_bf16_cpu())


def default_prenormalize(approx_kind: str) -> dict:
    """Pre-normalization (module docstring): on (frobenius, ε = 1e-7) for the polynomial iterations, off otherwise."""
    if approx_kind in POLYNOMIAL_APPROXES:
        return {"kind": "frobenius", "eps": 1e-7}
    return {"kind": "none"}


def prenormalize(x: torch.Tensor, cfg: dict | None, approx_kind: str = "svd", inplace: bool = False) -> torch.Tensor:
    """Scale each matrix of ``x`` (..., m, n): ``frobenius`` D/(‖D‖_F + ε) (Muon reference code,
    Scion, paper eq. (4.1)), ``max`` D/max(‖D‖_F, ε) (torch.optim.Muon), ``none``. ``cfg`` None
    selects :func:`default_prenormalize`; a dict without ``kind`` means frobenius (the spec model's
    default). ``inplace``: divide ``x`` itself (a scratch copy)."""
    cfg = default_prenormalize(approx_kind) if cfg is None else cfg
    if cfg.get("kind", "frobenius") == "none":
        return x
    denom = _prenorm_denominator(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), cfg)
    return x.div_(denom) if inplace else torch.div(x, denom)


def _prenorm_denominator(norm: torch.Tensor, cfg: dict) -> torch.Tensor:
    """What :func:`prenormalize` divides a matrix by, from its ‖D‖_F (cfg kind frobenius or max)."""
    kind = cfg.get("kind", "frobenius")
    eps = float(cfg.get("eps", 1e-7))
    if kind == "frobenius":
        return norm + eps
    if kind == "max":
        return norm.clamp(min=eps)
    raise ValueError(f"unknown prenormalize kind {kind!r}; expected frobenius, max or none")


def _working(x: torch.Tensor, kind: str, dtype: str) -> torch.Tensor:
    """x, a (..., m, n) tensor, in the approximation's working dtype (:func:`compute_dtype`)."""
    if x.ndim < 2:
        raise ValueError(f"{kind}: expected a (..., m, n) tensor, got shape {tuple(x.shape)}")
    return x.to(compute_dtype(x, kind, dtype))


def _prepare(x: torch.Tensor, kind: str, dtype: str, prenorm: dict | None) -> torch.Tensor:
    # Cast first, then normalize in the working dtype (as torch.optim.Muon does in bf16), in place
    # on the cast copy
    work = _working(x, kind, dtype)
    return prenormalize(work, prenorm, kind, inplace=work is not x)


def _prenorm_factor(sq_norm: torch.Tensor, cfg: dict) -> torch.Tensor | None:
    """The factor :func:`prenormalize` multiplies a matrix by, from its ‖D‖²_F (None for ``none``)."""
    if cfg.get("kind", "frobenius") == "none":
        return None
    return _prenorm_denominator(sq_norm.sqrt(), cfg).reciprocal()


# ---------------------------------------------------------------- the approximations

#: approx kind → ``fn(x, ref, *, prenormalize, dtype, scale, out_dtype, **options)``
APPROX_OPS = Registry("spectral approx")


def _rank_tol(sigma_max: torch.Tensor, m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # LAPACK's numerical-rank tolerance (as torch.linalg.matrix_rank): singular values below it are
    # rounding noise of a zero, and are mapped to (h*)'(0) = 0 rather than to (h*)'(noise).
    return max(m, n) * torch.finfo(dtype).eps * sigma_max


@APPROX_OPS.register("svd")
def svd(x: torch.Tensor, ref: Reference, *, prenormalize: dict | None = None, dtype: str = "auto",
        scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact ∇φ*(D) = U·Diag((h*)'(σ))·Vᵀ from the reduced SVD (paper Corollary 3.2; reduced
    suffices because (h*)'(0) = 0, Example 3.3). σ below the numerical-rank tolerance
    max(m, n)·u·σ_max count as 0. ``scale`` multiplies the mapped σ (free), the result is in
    ``out_dtype`` (default: x's), as for every approximation."""
    work = _prepare(x, "svd", dtype, prenormalize)
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    tol = _rank_tol(s[..., :1], *work.shape[-2:], work.dtype)
    mapped = torch.where(s > tol, ref.dual_grad(s) * scale, torch.zeros_like(s))
    return ((u * mapped.unsqueeze(-2)) @ vh).to(out_dtype or x.dtype)


@APPROX_OPS.register("gram_eigh")
def gram_eigh(x: torch.Tensor, ref: Reference, *, prenormalize: dict | None = None, dtype: str = "auto",
              scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """∇φ*(D) from the smaller Gram matrix: for m ≤ n, DDᵀ = QΛQᵀ, σ = √λ and
    ∇φ*(D) = Q·Diag((h*)'(σ)/σ)·QᵀD (the isotropic factor, finite at σ = 0, so D's columns are never
    divided by σ); tall matrices use DᵀD. Exact in float64 (the default): the Gram matrix resolves
    σ only down to √(max(m,n)·u)·σ_max ≈ 1.5e-8·√max(m,n)·σ_max, and smaller σ are treated as 0
    (mapped to (h*)'(0) = 0; the component of D along them is below rounding anyway)."""
    work = _prepare(x, "gram_eigh", dtype, prenormalize)
    m, n = work.shape[-2:]
    a = work if m <= n else work.mT
    lam, q = torch.linalg.eigh(a @ a.mT)
    sigma = lam.clamp(min=0).sqrt()
    tol = math.sqrt(max(m, n) * torch.finfo(work.dtype).eps) * sigma[..., -1:]
    factor = torch.where(sigma > tol, ref.iso_factor(sigma) * scale, torch.zeros_like(sigma))
    out = (q * factor.unsqueeze(-2)) @ (q.mT @ a)
    return (out if m <= n else out.mT).to(out_dtype or x.dtype)


def odd_quintic_iteration(x: torch.Tensor, coefficients: Sequence[Triple], *, prenorm: dict | None = None,
                          overwrite: bool = False, scale: float = 1.0,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale``·p_k(…p_1(D̂)) in ``out_dtype`` (default: x's), D̂ = x pre-normalized by ``prenorm``
    (a :func:`prenormalize` cfg; None: none) and p(X) = aX + (b·A + c·A²)X, A = XXᵀ, per triple;
    tall matrices are transposed so A is the small side (the map commutes with transposition).
    ``overwrite``: x is the caller's scratch. On CPU the op sequence is torch.optim.Muon's
    (normalize, then addmm with beta/alpha), so in bf16 it reproduces
    ``_zeropower_via_newtonschulz`` exactly; on CUDA the same map is computed without copies or
    passes over X beyond the products (:data:`_MUON_ORDER_DEVICES`, :func:`_folded_iteration`)."""
    cfg = {"kind": "none"} if prenorm is None else prenorm
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not muon_order(x.device):
        return _folded_iteration(x, coefficients, cfg, scale, out_dtype)
    X = prenormalize(x, cfg, inplace=overwrite)
    m, n = X.shape[-2:]
    tall = m > n
    # contiguous: baddbmm's result takes its input's strides, so a transposed start would keep
    # every later product on the slow strided path
    if tall:
        X = _transposed_copy(X)
    lead = X.shape[:-2]
    if X.ndim >= 3:
        X = X.reshape(-1, *X.shape[-2:])
        mm_add = torch.baddbmm
    else:
        mm_add = torch.addmm
    for a, b, c in coefficients:
        gram = X @ X.mT
        update = mm_add(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        X = mm_add(X, update, X, beta=a)  # a·X + (b·A + c·A²)·X
    X = X.reshape(*lead, *X.shape[-2:])
    # tall: hand back the input's layout, so that the cast and the update that follow read memory
    # in order (a transposed view costs them a strided pass each)
    X = (_transposed_copy(X) if tall else X).to(out_dtype)
    return X if scale == 1.0 else X * scale


# Devices where the iteration follows torch.optim.Muon's op sequence (pre-normalize X, transpose
# tall matrices into a copy so that A = XXᵀ is the small side, a·X added by the product's β): the
# same bf16 bits on CPU. Elsewhere (CUDA) :func:`_folded_iteration` computes the same map with no
# pass over X but the products (the passes it saves cost about a third of a GPT-2-small Muon
# step's elementwise time on an H100, benchmarks/RESULTS.md). Its bf16 error against float64 is
# no worse where σ spans three decades (0.84–0.97× Muon's) and up to 2.2× Muon's where σ spans
# one (a + (bA + cA²)ᵢᵢ rounded to bf16 loses the diagonal's low bits; Muon adds a·X in the
# product's fp32 epilogue, at the price of copying X into the output each step); tested.
_MUON_ORDER_DEVICES = ("cpu",)


def muon_order(device: torch.device) -> bool:
    """Whether work on ``device`` follows torch.optim.Muon's op sequence (the same bits on CPU), or
    the shorter forms of :func:`_folded_iteration` and the optimizer's one-pass update."""
    return device.type in _MUON_ORDER_DEVICES


def _folded_iteration(x: torch.Tensor, coefficients: Sequence[Triple], prenorm: dict, scale: float,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`odd_quintic_iteration` with every scaling folded into the small factor
    F = aI + b·A + c·A² of a step, X ← X·F for tall X (A = XᵀX: nothing is transposed) and F·X
    otherwise (a product without an addend: baddbmm would first copy X into its output):

    - pre-normalization: ‖D‖²_F = tr(A₁), and with D̂ = f·D the first step is X₁ = (f·F̂₁)·D,
      F̂₁ built from A₁·f² (f = 1/(‖D‖_F + ε), or 1/max(‖D‖_F, ε)); no pass over D;
    - ``scale`` multiplies the last F, and the last product writes ``out_dtype`` directly where
      the device's bmm can (fp32 from bf16 operands on CUDA: :func:`_bmm_into`)."""
    m, n = x.shape[-2:]
    right = m > n
    lead = x.shape[:-2]
    X = x.reshape(-1, m, n)
    if not coefficients:
        sq = (X.float() ** 2).sum(dim=(-2, -1))
        f = _prenorm_factor(sq, prenorm)
        out = X * (scale if f is None else f[:, None, None] * scale)
        return out.to(out_dtype).reshape(*lead, m, n)
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        gram = X.mT @ X if right else X @ X.mT
        factor = 1.0 if i < last else scale
        if i == 0:
            f = _prenorm_factor(gram.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32), prenorm)
            if f is not None:
                # in the working dtype (bf16 on CUDA: rounded as torch Muon's bf16 norm is; a
                # same-dtype product runs at 1.5× the speed of a mixed one, measured on an H100)
                gram.mul_((f * f).to(gram.dtype)[:, None, None])
                factor = (f * factor).to(gram.dtype)[:, None, None]
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        update.diagonal(dim1=-2, dim2=-1).add_(a)
        if not isinstance(factor, float) or factor != 1.0:
            update.mul_(factor)
        if i < last:
            X = X @ update if right else update @ X
        else:
            X = _bmm_into(X, update, out_dtype) if right else _bmm_into(update, X, out_dtype)
    return X.reshape(*lead, m, n)


_OUT_DTYPE_BMM: dict = {}  # (device type, operand dtype, out dtype) → whether torch.bmm takes it


def _bmm_into(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b (batched) in ``out_dtype``: bf16 operands accumulate in fp32 in the matrix units
    either way, so where torch's bmm takes ``out_dtype`` (CUDA, torch ≥ 2.8) the product is
    written in fp32 directly, without rounding to bf16 and a cast pass; elsewhere it is rounded
    to the operands' dtype and cast."""
    if out_dtype == a.dtype:
        return a @ b
    key = (a.device.type, a.dtype, out_dtype)
    if _OUT_DTYPE_BMM.get(key, True):
        try:
            out = torch.bmm(a, b, out_dtype=out_dtype)
            _OUT_DTYPE_BMM[key] = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_BMM[key] = False
    return (a @ b).to(out_dtype)


def _transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """``x.mT`` as a contiguous tensor, matrix by matrix: torch's 2-D transpose copy is blocked,
    its batched one is not (CPU: about 2× faster for 1024×4096 bf16). Values are copied exactly."""
    m, n = x.shape[-2:]
    out = torch.empty(*x.shape[:-2], n, m, dtype=x.dtype, device=x.device)
    for src, dst in zip(x.reshape(-1, m, n), out.view(-1, n, m)):
        dst.copy_(src.mT)
    return out


def _polynomial(x, kind, coeffs, dtype, prenorm, scale, out_dtype) -> torch.Tensor:
    work = _working(x, kind, dtype)
    cfg = default_prenormalize(kind) if prenorm is None else prenorm
    return odd_quintic_iteration(work, coeffs, prenorm=cfg, overwrite=work is not x, scale=scale,
                                 out_dtype=out_dtype or x.dtype)


@APPROX_OPS.register("newton_schulz")
def newton_schulz(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    prenormalize: dict | None = None,
    dtype: str = "auto",
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quintic Newton–Schulz on the pre-normalized D (Muon; default triple
    (3.4445, −4.7750, 2.0315), one triple reused or one per step). Realizes its own map,
    ≈ the κ = 4 power barrier of :func:`realized_reference`; ``ref`` is ignored."""
    coeffs = newton_schulz_coefficients(steps, coefficients)
    return _polynomial(x, "newton_schulz", coeffs, dtype, prenormalize, scale, out_dtype)


def gram_quintic_iteration(x: torch.Tensor, coefficients: Sequence[Triple], *, prenorm: dict | None = None,
                           restarts: Sequence[int] = (2,), scale: float = 1.0,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`odd_quintic_iteration`'s map (``scale``·p_k(…p_1(D̂)), D̂ = x pre-normalized by
    ``prenorm``) iterated on the small Gram side (restarted Gram Newton–Schulz: Dao AI Lab,
    https://dao-lab.ai/blog/2026/gram-newton-schulz/, as microsoft/dion runs it). For X (m×n,
    m ≤ n) a step is X ← Q·X with Q = aI + P, P = bA + cA², A = XXᵀ; Q is a polynomial in A, so
    with X = R·X₀ only the m×m matrices are iterated:

        R ← Q·R,   A ← Q·A·Q   (= A·Q²: Q commutes with A)

    and the rectangular product X = R·X₀ is formed at the end and after each step of ``restarts``
    (1-based step numbers; there A = XXᵀ is recomputed from the new X and R starts again from I:
    the Gram recursion squares the conditioning, and restarting bounds how far rounding in A
    travels). Steps listed at or past the last are ignored. A step costs up to four m×m products
    (P; R ← Q·R unless R was just reset; A ← Q·A·Q, two, unless X is formed next) where
    newton_schulz's costs two m×m×n products and one m×m; the m×m×n products are the first Gram
    matrix, X and its Gram matrix at each restart, and X at the end (5 steps, restart after 2: 4
    against 10; it pays where m ≪ n, benchmarks/gram_ns.py). Tall matrices are read transposed
    (A = XᵀX, X ← X·Q, R accumulated on the right): nothing is copied.

    Accuracy: equal to newton_schulz to ≤ 2e-11 in float64; in float32 within its rounding on
    rectangular matrices, while on square ones (σ down to σ_max/n, squared in A) 8 steps with one
    restart lose 1e-3, restarts every two steps keep it at 4e-6 (tests/test_gram_newton_schulz.py).

    Pre-normalization and ``scale`` are folded into R: ‖D‖²_F = tr(A₀) (summed in at least
    float32, float64 for float64 work), A₀ is scaled by f² and the first Q by f
    (f = 1/(‖D‖_F + ε) or 1/max(‖D‖_F, ε)); ``scale`` multiplies the last R. The result is in
    ``out_dtype`` (default: x's)."""
    cfg = {"kind": "none"} if prenorm is None else prenorm
    out_dtype = x.dtype if out_dtype is None else out_dtype
    m, n = x.shape[-2:]
    right = m > n  # tall: the n×n Gram XᵀX, products on the right
    lead = x.shape[:-2]
    X = x.reshape(-1, m, n)

    def gram(X: torch.Tensor) -> torch.Tensor:
        return X.mT @ X if right else X @ X.mT

    def times(R: torch.Tensor, X: torch.Tensor) -> torch.Tensor:  # R acting on X: R·X, or X·R for tall X
        return X @ R if right else R @ X

    A = gram(X)
    sq = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=working_dtype(A.dtype))
    f = _prenorm_factor(sq, cfg)
    pending = None if f is None else f.to(A.dtype)[:, None, None]  # folded into the first Q
    if pending is not None:
        A.mul_(pending * pending)
    steps = len(coefficients)
    if steps == 0:
        factor = scale if pending is None else pending * scale
        return (X * factor).to(out_dtype).reshape(*lead, m, n)
    restart_after = {int(r) for r in restarts}
    R = None
    for i, (a, b, c) in enumerate(coefficients, start=1):
        P = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        if R is None:  # R = Q (times the pending pre-normalization)
            R = P.clone() if i < steps and i not in restart_after else P
            R.diagonal(dim1=-2, dim2=-1).add_(a)
            if pending is not None:
                R.mul_(pending)
                pending = None
        else:  # R ← Q·R = aR + P·R (tall: R·Q)
            R = torch.baddbmm(R, R, P, beta=a) if right else torch.baddbmm(R, P, R, beta=a)
        if i == steps:
            break
        if i in restart_after:  # form X, recompute its Gram matrix, start R again
            X = times(R, X)
            A = gram(X)
            R = None
        else:  # A ← Q·A·Q: T = aA + P·A = Q·A, then A = aT + T·P = Q·A·Q
            T = torch.baddbmm(A, P, A, beta=a)
            A = torch.baddbmm(T, T, P, beta=a)
    if scale != 1.0:
        R = R * scale
    out = _bmm_into(X, R, out_dtype) if right else _bmm_into(R, X, out_dtype)
    return out.reshape(*lead, m, n)


@APPROX_OPS.register("gram_newton_schulz")
def gram_newton_schulz(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: Sequence[Sequence[float]] | None = None,
    restarts: Sequence[int] = (2,),
    prenormalize: dict | None = None,
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


@APPROX_OPS.register("polar_express")
def polar_express(
    x: torch.Tensor,
    ref: Reference | None = None,
    *,
    steps: int = 5,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    prenormalize: dict | None = None,
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


def apply_approx(x: torch.Tensor, ref: Reference | None, approx: dict | None, prenorm: dict | None = None, *,
                 scale: float = 1.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dispatch an ``approx`` dict (``model_dump()`` of a spec approx) on ``x`` (..., m, n):
    ``scale``·∇φ*(x) in ``out_dtype`` (default: x's), the scale folded into the approximation."""
    approx = {"kind": "svd"} if approx is None else dict(approx)
    kind = approx.pop("kind", "svd")
    if kind not in APPROX_OPS:
        raise ValueError(f"unknown spectral approx {kind!r}; expected one of {', '.join(APPROX_OPS)}")
    if ref is None and kind in ("svd", "gram_eigh"):
        raise ValueError(f"approx {kind!r} needs a reference function")
    return APPROX_OPS[kind](x, ref, prenormalize=prenorm, scale=scale, out_dtype=out_dtype, **approx)
