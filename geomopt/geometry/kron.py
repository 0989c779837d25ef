"""Geometries that learn their metric from Kronecker factors: Shampoo (Gupta, Koren and Singer
2018; Anil et al. 2020) and SOAP (Vyas et al. 2024), as pure functions on one gradient matrix
(m, n) or a bucket's stack (b, m, n), the state passed in and updated in place (torch.optim's
functional form).

Both keep, per matrix, the factor statistics L ← β·L + w·G·Gᵀ (m × m) and R ← β·R + w·Gᵀ·G
(n × n) (:func:`update_factors`). Shampoo steps along L^(−1/p)·G·R^(−1/p) with p = 2k, k the
number of factors kept (:func:`root_order`), the inverse roots (:mod:`geomopt.geometry.kron_root`)
recomputed every few steps (:func:`refresh_due`), the direction rescaled to another direction's
Frobenius norm (:func:`graft`). SOAP runs Adam in the eigenbases Q_L, Q_R of L and R
(:func:`soap_direction`), the bases refreshed by one power iteration and a QR
(:func:`soap_refresh`). A side whose dimension exceeds ``max_dim`` keeps no factor (None) and
uses the identity there (embeddings, heads over a vocabulary).

The formulas, and where the implementations this is tested against (pytorch-optimizer 4.1's
``Shampoo``, ``ScalableShampoo`` and ``SOAP``) differ from the papers: docs/reference/kron.md.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from geomopt.geometry.kron_root import as_stack, inverse_root_eigh, inverse_root_newton

Factor = Optional[torch.Tensor]

def init_factors(shape: tuple[int, ...], max_dim: Optional[int] = None, *, eps: float = 0.0,
                 dtype: torch.dtype = torch.float32, device=None) -> tuple[Factor, Factor]:
    """The factors (L, R) of a matrix (m, n) or a stack (b, m, n): ε·I of size m and n (stacked
    like the matrix), or None for a side longer than ``max_dim`` (None: every side kept). ε = 0
    gives empty statistics; ε = 1 the identity, the roots' value before their first refresh."""
    *batch, m, n = shape

    def one(k: int) -> Factor:
        if max_dim is not None and k > max_dim:
            return None
        return (eps * torch.eye(k, dtype=dtype, device=device)).expand(*batch, k, k).clone()

    return one(m), one(n)


def update_factors(g: torch.Tensor, left: Factor, right: Factor, *, beta: float, weight: float) -> None:
    """L ← β·L + w·G·Gᵀ and R ← β·R + w·Gᵀ·G in place, per matrix (w = 1 and β = 1: Shampoo's sum;
    w = 1 − β: the moving average). A None factor is not kept and not computed."""
    g3 = as_stack(g)
    for f, a, b in ((left, g3, g3.mT), (right, g3.mT, g3)):
        if f is not None:
            as_stack(f).baddbmm_(a.to(f.dtype), b.to(f.dtype), beta=beta, alpha=weight)


def root_order(left: Factor, right: Factor, override: Optional[int] = None) -> int:
    """The root order p of L^(−1/p)·G·R^(−1/p): 2k with k the number of factors kept (the classic
    two-sided −1/4; −1/2 on the kept side of a one-sided one), or ``override``."""
    if override is not None:
        return override
    return 2 * sum(f is not None for f in (left, right))


def refresh_due(step: int, every: int) -> bool:
    """Whether the roots (Shampoo) or the bases (SOAP) are recomputed at ``step`` (1-based): every
    ``every`` steps, at step = every, 2·every, … (both references' schedule)."""
    return step % every == 0


def refresh_roots(left: Factor, right: Factor, left_root: Factor, right_root: Factor, *, p: float,
                  eps: float = 0.0, method: str = "eigh", **newton) -> None:
    """Write (F + εI)^(−1/p) of each kept factor F into its root, in place: by eigh
    (:func:`~geomopt.geometry.kron_root.inverse_root_eigh`) or by the coupled Newton iteration
    (``method="newton"``, :func:`~geomopt.geometry.kron_root.inverse_root_newton`, ``newton``
    its tolerance and iteration cap)."""
    if method not in ("eigh", "newton"):
        raise ValueError(f"root method {method!r} is not 'eigh' or 'newton'")
    for f, r in ((left, left_root), (right, right_root)):
        if f is None or r is None:
            continue
        root = inverse_root_eigh(f, p, eps) if method == "eigh" else inverse_root_newton(f, int(p), eps, **newton)
        r.copy_(root)


def shampoo_direction(g: torch.Tensor, left_root: Factor, right_root: Factor) -> torch.Tensor:
    """L^(−1/p)·G·R^(−1/p) per matrix from the roots (a None root: the identity on that side), in
    the roots' dtype (float32 at least), shaped like ``g``."""
    roots = [r for r in (left_root, right_root) if r is not None]
    dtype = roots[0].dtype if roots else g.dtype
    d = as_stack(g).to(dtype)
    if left_root is not None:
        d = as_stack(left_root) @ d
    if right_root is not None:
        d = d @ as_stack(right_root)
    if not roots:
        d = d.clone()
    return d.reshape(g.shape)


def graft(d: torch.Tensor, graft_direction: torch.Tensor, tiny: float = 1e-16) -> torch.Tensor:
    """Grafting (Agarwal et al. 2020): D·‖E‖_F/(‖D‖_F + tiny) per matrix, in place on ``d``: the
    direction D keeps its orientation and takes the step length of E, another optimizer's direction
    (AdaGrad's or Adam's diagonal one, Muon's orthogonalized one), computed by the caller."""
    return graft_to_norm(d, torch.linalg.matrix_norm(as_stack(graft_direction).to(d.dtype), keepdim=True), tiny)


def graft_to_norm(d: torch.Tensor, norm, tiny: float = 1e-16) -> torch.Tensor:
    """D·n/(‖D‖_F + tiny) per matrix, in place on ``d``: :func:`graft` to a step length ``n`` known
    without a direction (a number, or one per matrix shaped (b, 1, 1))."""
    d3 = as_stack(d)
    d3.mul_(norm / (torch.linalg.matrix_norm(d3, keepdim=True) + tiny))
    return d


# ---------------------------------------------------------------- SOAP


def rotate(x: torch.Tensor, q_left: Factor, q_right: Factor) -> torch.Tensor:
    """X' = Q_Lᵀ·X·Q_R per matrix (a None basis: the identity): X in the factors' eigenbases."""
    x3 = as_stack(x)
    if q_left is not None:
        x3 = as_stack(q_left).mT @ x3
    if q_right is not None:
        x3 = x3 @ as_stack(q_right)
    return x3.reshape(x.shape)


def unrotate(x: torch.Tensor, q_left: Factor, q_right: Factor) -> torch.Tensor:
    """X = Q_L·X'·Q_Rᵀ per matrix, the inverse of :func:`rotate` (the bases are orthogonal)."""
    x3 = as_stack(x)
    if q_left is not None:
        x3 = as_stack(q_left) @ x3
    if q_right is not None:
        x3 = x3 @ as_stack(q_right).mT
    return x3.reshape(x.shape)


def soap_bases(left: Factor, right: Factor) -> tuple[Factor, Factor]:
    """The eigenbases of the factors, eigenvectors by decreasing eigenvalue (torch.linalg.eigh's
    columns reversed): SOAP's bases at their first computation. Row-major, as a checkpoint's
    entries come back: eigh's column-major vectors would be multiplied by other kernels (other bits)
    than the same values restored, and a resume would leave the run's path."""
    return tuple(None if f is None else torch.linalg.eigh(f)[1].flip(-1).contiguous()  # type: ignore[return-value]
                 for f in (left, right))


def soap_refresh(left: Factor, right: Factor, q_left: Factor, q_right: Factor, exp_avg_sq: torch.Tensor) -> None:
    """One power iteration and a QR per kept side, in place (Vyas et al. 2024): with
    P = F·Q, the columns of P (and the rotated second moment's rows for L, its columns for R) are put
    in decreasing order of the estimated eigenvalues diag(Qᵀ·F·Q), and Q ← the Q of P's QR. The
    second moment is only reordered, not re-projected into the new basis (as the references do:
    the new basis is one power step from the old). The QR runs in float32 at least (the reference
    casts to float32 whatever the dtype, so its float64 runs take bases accurate to ~1e-7)."""
    v = as_stack(exp_avg_sq)
    for f, q, dim in ((left, q_left, -2), (right, q_right, -1)):
        if f is None or q is None:
            continue
        f3, q3 = as_stack(f), as_stack(q)
        power = f3 @ q3
        est = (q3 * power).sum(dim=-2)
        order = torch.argsort(est, dim=-1, descending=True)
        v.copy_(torch.take_along_dim(v, order.unsqueeze(-1 if dim == -2 else -2), dim=dim))
        power = torch.take_along_dim(power, order.unsqueeze(-2), dim=-1)
        q3.copy_(torch.linalg.qr(power.to(torch.promote_types(power.dtype, torch.float32)))[0])


def soap_direction(g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, q_left: Factor,
                   q_right: Factor, *, betas: tuple[float, float], eps: float, step: int) -> torch.Tensor:
    """Adam in the rotated basis, as the reference implementation keeps it: m ← β₁m + (1−β₁)G in
    G's own basis, v' ← β₂v' + (1−β₂)(Q_Lᵀ·G·Q_R)² in the rotated one (both in place), and the
    direction Q_L·[(Q_Lᵀ·m·Q_R)/(√v' + ε)]·Q_Rᵀ·√(1−β₂ᵗ)/(1−β₁ᵗ), t = ``step`` the number of moment
    updates (ε added before the bias correction: ε/√(1−β₂ᵗ) in torch.optim.Adam's placement)."""
    beta1, beta2 = betas
    g_rot = rotate(g, q_left, q_right)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.lerp_(g_rot.square(), 1 - beta2)
    denom = exp_avg_sq.sqrt().add_(eps)
    d = unrotate(rotate(exp_avg, q_left, q_right) / denom, q_left, q_right)
    return d.mul_(math.sqrt(1 - beta2**step) / (1 - beta1**step))
