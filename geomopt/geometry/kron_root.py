"""Inverse p-th roots (A + εI)^(−1/p) of symmetric PSD Kronecker factors, the roots Shampoo
preconditions with (:mod:`geomopt.geometry.kron`): exactly by eigh, or by the coupled Newton
iteration of Guo and Higham (2006), matmuls only.

Both act on one matrix (m, m) or a stack (b, m, m), one matrix per row of a bucket, and return a
new tensor of the input's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from geomopt.geometry.matrix import working_dtype


def as_stack(x: torch.Tensor) -> torch.Tensor:
    """``x`` (m, n) or (b, m, n) as a stack (b, m, n): a single matrix is the stack of one (a view,
    so in-place updates of it reach ``x``)."""
    if x.ndim not in (2, 3):
        raise ValueError(f"expected a matrix (m, n) or a stack (b, m, n), got shape {tuple(x.shape)}")
    return x.unsqueeze(0) if x.ndim == 2 else x


def _square_stack(a: torch.Tensor) -> torch.Tensor:
    """:func:`as_stack` of square matrices."""
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expected a square matrix (m, m) or a stack (b, m, m), got shape {tuple(a.shape)}")
    return as_stack(a)


#: the largest u₃₂·κ, κ = (λ_max + ε)/(λ_min + ε), at which a float32 factor's root is computed in
#: float32 (u₃₂ = 2⁻²⁴): its relative error is then a few × 1e-5 (measured: about u₃₂·κ); past it, float64
FLOAT32_ROOT_TOL = 1e-5
_U32 = 2.0**-24


def _root_from_eigh(lam: torch.Tensor, q: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    """Q·diag((max(λ, 0) + ε)^(−1/p))·Qᵀ in Q's dtype, the powers taken in float64 (float32's
    vectorized and scalar pow round differently, so a matrix would not get the same bits in a
    stack as alone)."""
    scale = lam.to(torch.float64).clamp_min(0.0).add_(eps).pow_(-1.0 / p).to(q.dtype)
    return (q * scale.unsqueeze(-2)) @ q.mT


def _well_conditioned(a3: torch.Tensor, eps: float) -> torch.Tensor:
    """Per matrix, whether A + εI (float32) is safely far from singular for a float32 root: the
    Cholesky factorization of A + εI − δI, δ = ‖A + εI‖_F·u₃₂/tol, exists, so λ_min + ε > δ and
    u₃₂·κ < tol (‖·‖_F ≥ λ_max). A third of an eigh's cost; the eigenvalues check it after."""
    n = a3.shape[-1]
    eye = torch.eye(n, dtype=a3.dtype, device=a3.device)
    shifted = a3 + eps * eye
    delta = torch.linalg.matrix_norm(shifted, keepdim=True) * (_U32 / FLOAT32_ROOT_TOL)
    return torch.linalg.cholesky_ex(shifted - delta * eye)[1] == 0


def inverse_root_eigh(a: torch.Tensor, p: float, eps: float = 0.0) -> torch.Tensor:
    """(A + εI)^(−1/p) = Q·diag((max(λ, 0) + ε)^(−1/p))·Qᵀ from A = Q·diag(λ)·Qᵀ. λ is clamped at 0
    before the damping: a PSD factor's eigenvalues below 0 are rounding, and (λ + ε)^(−1/p) with
    λ < −ε would be NaN. With ε = 0 the factor must be positive definite (a zero eigenvalue gives +∞).

    Float64 factors are computed in float64. A float32 (or lower) factor is computed in float32
    where that is accurate, else in float64, per matrix: eigh is backward stable (the computed
    root is that of A + E, ‖E‖ ≈ u·‖A‖), so the root's relative error is about u·κ, κ =
    (λ_max + ε)/(λ_min + ε); float32 (twice as fast on CPU) is taken where u₃₂·κ ≤
    :data:`FLOAT32_ROOT_TOL`, checked before (:func:`_well_conditioned`) and after (the computed
    eigenvalues); an ill-conditioned factor's small eigenvalues, raised to −1/p, would carry
    float32's rounding, so it takes float64 (exact to ~1e-16·‖A‖)."""
    if p <= 0:
        raise ValueError(f"the root order p must be positive, got {p}")
    a3 = _square_stack(a)
    out = torch.empty(a3.shape, dtype=torch.float64 if a.dtype == torch.float64 else torch.float32,
                      device=a.device)
    wide = torch.ones(a3.shape[0], dtype=torch.bool, device=a.device)
    if a.dtype != torch.float64:
        a32 = a3.to(torch.float32)
        fast = _well_conditioned(a32, eps)
        if bool(fast.any()):
            lam, q = torch.linalg.eigh(a32[fast])
            lam.clamp_min_(0.0).add_(eps)
            ok = _U32 * lam[:, -1] <= FLOAT32_ROOT_TOL * lam[:, 0]
            idx = fast.nonzero().squeeze(-1)[ok]
            out[idx] = _root_from_eigh(lam[ok], q[ok], p, 0.0)
            wide[idx] = False
    if bool(wide.any()):
        lam, q = torch.linalg.eigh(a3[wide].to(torch.float64))
        out[wide] = _root_from_eigh(lam, q, p, eps).to(out.dtype)
    return out.to(a.dtype).reshape(a.shape)


def inverse_root_newton(a: torch.Tensor, p: int, eps: float = 0.0, *, tol: Optional[float] = None,
                        max_iters: int = 100, max_error_ratio: float = 1.2) -> torch.Tensor:
    """(A + εI)^(−1/p) by the coupled Newton iteration (Guo and Higham, "A Schur–Newton method for the
    matrix p-th root and its inverse", SIAM J. Matrix Anal. Appl. 28 (2006), eq. 3.4): with
    B = A + εI, z = (p + 1)/(2‖B‖_F), X₀ = z^(1/p)·I and M₀ = z·B (so M₀'s eigenvalues lie in
    (0, (p+1)/2]), iterate

        T_k = ((p + 1)·I − M_k)/p,   X_{k+1} = X_k·T_k,   M_{k+1} = T_k^p·M_k,

    which keeps M_k = X_k^p·B and sends M_k → I, X_k → B^(−1/p) (quadratically near the end; a
    small eigenvalue μ of M grows by ((p+1)/p)^p ≥ 2 per iteration before). Each matrix of a stack
    stops on its own, when ‖M_k − I‖_max ≤ ``tol`` (its X stays X_k) or when ‖M_k − I‖_F grew by more
    than ``max_error_ratio`` (its X stays the previous one), so a matrix gives the same bits in a
    stack as alone; at most ``max_iters`` iterations. The growth test reads the Frobenius norm,
    which cannot grow in exact arithmetic (each eigenvalue μ ∈ (0, p + 1) of M moves to
    μ·((p + 1 − μ)/p)^p ∈ (0, 1], no farther from 1), so what grows it is rounding; the largest
    entry may grow while the iteration converges (by 1.26× in the first iteration for a 5 × 5
    factor of κ = 420, p = 4). ``tol`` defaults to 1e-6 in float32, 1e-12 in float64 (X's relative
    error is about tol/p). Computed in float32 at least (float64 stays float64). ``p`` is a
    positive integer (T_k^p is a matrix power)."""
    if int(p) != p or p < 1:
        raise ValueError(f"the Newton iteration needs a positive integer root order p, got {p}")
    p = int(p)
    a3 = _square_stack(a)
    dtype = working_dtype(a.dtype)
    if tol is None:
        tol = 1e-12 if dtype == torch.float64 else 1e-6
    b, n, _ = a3.shape
    eye = torch.eye(n, dtype=dtype, device=a.device).expand(b, n, n)
    m = a3.to(dtype) + eps * eye
    z = (p + 1) / (2 * torch.linalg.matrix_norm(m, keepdim=True))
    x = eye * z.pow(1.0 / p)
    m = m * z
    dist = torch.linalg.matrix_norm(m - eye)
    active = torch.ones(b, dtype=torch.bool, device=a.device)
    for _ in range(max_iters):
        t = ((p + 1) * eye - m) / p
        x_new = x @ t
        m_new = torch.linalg.matrix_power(t, p) @ m
        r_new = m_new - eye
        dist_new = torch.linalg.matrix_norm(r_new)
        step = active & (dist_new <= max_error_ratio * dist)
        keep = step.view(b, 1, 1)
        x = torch.where(keep, x_new, x)
        m = torch.where(keep, m_new, m)
        dist = torch.where(step, dist_new, dist)
        active = step & (r_new.abs().amax(dim=(-2, -1)) > tol)
        if not bool(active.any()):
            break
    return x.to(a.dtype).reshape(a.shape)
