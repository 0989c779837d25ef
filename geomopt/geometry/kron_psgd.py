"""PSGD-Kron (Li 2018, "Preconditioner on matrix Lie group for SGD"; Kron as in Evan Walters'
psgd_jax and pytorch-optimizer 4.1's ``Kron``) as pure functions on one matrix (m, n) or a
bucket's stack (b, m, n), the state passed in and updated in place.

The preconditioner is P = (Q_Lᵀ·Q_L) ⊗ (Q_Rᵀ·Q_R): a direction G steps along
P·G = Q_Lᵀ·Q_L·G·Q_Rᵀ·Q_R (:func:`precondition`). Each factor Q is upper triangular (m × m) or,
for a side of 1 or one longer than ``max_dim``, diagonal (a vector of m). The factors are fitted
by PSGD's criterion E[hᵀ·P·h + vᵀ·P⁻¹·v] on pairs (v, h) = (a probe V ~ N(0, I), the direction
G) with one step of relative gradient descent on the group of triangular matrices
(:func:`fit`): with A = Q_L·G·Q_Rᵀ and B = Q_L⁻ᵀ·V·Q_R⁻¹,

    Q_L ← Q_L − η·triu(A·Aᵀ − B·Bᵀ)/‖A·Aᵀ + B·Bᵀ‖ · Q_L
    Q_R ← Q_R − η·triu(Aᵀ·A − Bᵀ·B)/‖Aᵀ·A + Bᵀ·B‖ · Q_R

‖·‖ a lower bound of the spectral norm (:func:`norm_lower_bound`); a diagonal factor takes the
diagonal of the same terms over their largest entry. Over all P the criterion's minimizer solves
P·E[hhᵀ]·P = E[vvᵀ] = I: P = E[hhᵀ]^(−1/2), the metric Shampoo approximates by roots; the fit
approaches it within Kronecker products, without a root.

docs/reference/kron.md has the formulas and where ``Kron`` puts them.
"""

from __future__ import annotations

import torch

from geomopt.geometry.kron_root import as_stack
from geomopt.spec.geometries import kronecker_side

#: the smallest positive normal bfloat16 (= float32's): the fit's guard against 0/0
TINY = torch.finfo(torch.bfloat16).tiny
#: the probes' generator is seeded with this plus the step (:func:`probe`)
PROBE_SEED = 0x5053_4744
#: the update's RMS ceiling: P·G is scaled down to an RMS of 1.1 where it exceeds it (Kron's)
RMS_CAP = 1.1


def init_factors(shape: tuple[int, ...], max_dim=None, *, dtype: torch.dtype = torch.float32,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q_L, Q_R) of a matrix (m, n) or a stack (b, m, n) at the identity: I (k × k) for a side k
    kept triangular, a vector of ones (k) for a diagonal side (k = 1, or k > ``max_dim``)."""
    *batch, m, n = shape

    def one(k: int) -> torch.Tensor:
        if diagonal(k, max_dim):
            return torch.ones(*batch, k, dtype=dtype, device=device)
        return torch.eye(k, dtype=dtype, device=device).expand(*batch, k, k).clone()

    return one(m), one(n)


def diagonal(k: int, max_dim=None) -> bool:
    """Whether a side of ``k`` keeps a diagonal factor: k = 1, or k above ``max_dim`` (Kron's
    ``max_size_triangular``; :func:`geomopt.spec.geometries.kronecker_side`)."""
    return kronecker_side("psgd", k, max_dim) == "diagonal"


def _stack(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A factor of ``g`` (m, n) or (b, m, n) as a factor of the stack (b, ·): a view (in-place updates reach
    it)."""
    return q.unsqueeze(0) if g.ndim == 2 else q


def _is_diag(q: torch.Tensor) -> bool:
    """Whether a stacked factor (b, k) or (b, k, k) is diagonal."""
    return q.ndim == 2


def _left(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Q·X per matrix (a diagonal Q scales X's rows)."""
    return q.unsqueeze(-1) * x if _is_diag(q) else q @ x


def _right_t(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """X·Qᵀ per matrix (a diagonal Q scales X's columns)."""
    return x * q.unsqueeze(-2) if _is_diag(q) else x @ q.mT


def _solve_right(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """X·Q⁻¹ per matrix for an upper triangular Q (a triangular solve; a diagonal Q divides X's columns)."""
    if _is_diag(q):
        return x / q.unsqueeze(-2)
    return torch.linalg.solve_triangular(q, x, upper=True, left=False)


def precondition(g: torch.Tensor, q_left: torch.Tensor, q_right: torch.Tensor) -> torch.Tensor:
    """P·G = Q_Lᵀ·Q_L·G·Q_Rᵀ·Q_R per matrix of ``g`` (m, n) or (b, m, n)."""
    ql, qr = _stack(q_left, g), _stack(q_right, g)
    x = _left(ql, as_stack(g))
    x = _left(ql if _is_diag(ql) else ql.mT, x)
    x = _right_t(x, qr)
    x = _right_t(x, qr if _is_diag(qr) else qr.mT)
    return x.reshape(g.shape)


def norm_lower_bound(a: torch.Tensor) -> torch.Tensor:
    """A lower bound of ‖A‖₂ per matrix of a stack (b, k, k), shaped (b, 1, 1), between ‖A‖₂/√k and ‖A‖₂:
    with s = max|A_ij| and Â = A/s, x the column of Â of largest norm, s·‖xᵀ·Â·Âᵀ‖/‖xᵀ·Â‖ (one power step
    from it); the row where the row sums of squares are not below the column sums (Kron's
    ``norm_lower_bound``, op for op)."""
    max_abs = a.abs().amax(dim=(-2, -1), keepdim=True)
    a = a / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    aa = a * a
    value0, i = aa.sum(dim=-2).max(dim=-1)  # the largest column
    value1, j = aa.sum(dim=-1).max(dim=-1)  # the largest row
    tiny = torch.finfo(a.dtype).tiny

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(tiny)

    x0 = torch.take_along_dim(a, i.view(-1, 1, 1), dim=-1).mT @ a  # (b, 1, k): Â[:, i]ᵀ·Â
    bound0 = torch.linalg.vector_norm(unit(x0) @ a.mT, dim=(-2, -1), keepdim=True)
    x1 = a @ torch.take_along_dim(a, j.view(-1, 1, 1), dim=-2).mT  # (b, k, 1): Â·Â[j, :]ᵀ
    bound1 = torch.linalg.vector_norm(a.mT @ unit(x1), dim=(-2, -1), keepdim=True)
    return max_abs * torch.where((value0 > value1).view(-1, 1, 1), bound0, bound1)


def balance(q_left: torch.Tensor, q_right: torch.Tensor, like: torch.Tensor) -> None:
    """Q_L·c and Q_R/c in place per matrix of ``like`` (m, n) or (b, m, n), c = √(‖Q_R‖_max/‖Q_L‖_max): both
    factors' largest entries made their geometric mean. P is unchanged (c²·c⁻²), and so is every later fit
    step (A, B and the terms do not see c, and Q's step is relative to Q): it only keeps the factors' range
    from drifting (Kron balances at an update with probability 0.01)."""
    ql, qr = _stack(q_left, like), _stack(q_right, like)
    nl, nr = ql.abs().flatten(1).amax(dim=1), qr.abs().flatten(1).amax(dim=1)
    mean = (nl * nr) ** 0.5
    for q, n in ((ql, nl), (qr, nr)):
        q.mul_((mean / n).view(-1, *([1] * (q.ndim - 1))))


def fit(g: torch.Tensor, v: torch.Tensor, q_left: torch.Tensor, q_right: torch.Tensor, *, lr: float) -> None:
    """One step of PSGD's fit of (Q_L, Q_R) in place, per matrix of ``g`` (m, n) or (b, m, n), on the pair
    (V, G) of the probe V and the direction G (the module's docstring has the formula): a triangular factor
    by Q ← Q − η·triu(T₁ − T₂)/(‖T₁ + T₂‖ + tiny)·Q, a diagonal one by
    q ← q − η·(t₁ − t₂)·q/(max|t₁ + t₂| + tiny), T₁ the terms of A = Q_L·G·Q_Rᵀ, T₂ those of
    B = Q_L⁻ᵀ·V·Q_R⁻¹ (for Q_L: A·Aᵀ and B·Bᵀ, or their diagonals; for Q_R: Aᵀ·A and Bᵀ·B), both from the
    factors before the step."""
    ql, qr = _stack(q_left, g), _stack(q_right, g)
    a = _right_t(_left(ql, as_stack(g)), qr)
    b = _solve_right(_solve_right(as_stack(v).mT, ql).mT, qr)
    terms = []
    for q, side in ((ql, -1), (qr, -2)):
        if _is_diag(q):
            terms.append(((a * a).sum(dim=side), (b * b).sum(dim=side)))
        elif side == -1:
            terms.append((a @ a.mT, b @ b.mT))
        else:
            terms.append((a.mT @ a, b.mT @ b))
    for q, (t1, t2) in zip((ql, qr), terms):
        step = (t1 - t2) * lr
        if _is_diag(q):
            step = step * q / ((t1 + t2).abs().amax(dim=-1, keepdim=True) + TINY)
        else:
            step = (torch.triu(step) / (norm_lower_bound(t1 + t2) + TINY)) @ q
        q.sub_(step)


def probe(g: torch.Tensor, step: int) -> torch.Tensor:
    """V ~ N(0, I) of one matrix's shape (m, n), drawn from a generator seeded with :data:`PROBE_SEED` +
    ``step`` on ``g``'s device, in ``g``'s dtype, and given to every matrix of ``g`` (m, n) or (b, m, n)
    (a view).

    The fit's expectation is over each matrix's probes across steps, which are independent draws;
    matrices may share one at a step (each is fitted on its own). A function of the step alone, the
    probes are the same on every rank and after a resume, whatever the bucket, and leave torch's default
    generator alone."""
    gen = torch.Generator(device=g.device).manual_seed(PROBE_SEED + step)
    v = torch.randn(g.shape[-2:], generator=gen, dtype=g.dtype, device=g.device)
    return v.expand(g.shape)


def cap_rms(d: torch.Tensor, cap: float = RMS_CAP, eps: float = 1e-6) -> torch.Tensor:
    """D·min(cap/(RMS(D) + ε), 1) per matrix of ``d`` (m, n) or (b, m, n), in place: Kron's ceiling on the
    update's RMS (1.1, ε = 1e-6)."""
    d3 = as_stack(d)
    rms = d3.square().mean(dim=(-2, -1), keepdim=True).sqrt()
    d3.mul_(torch.clamp(cap / (rms + eps), max=1.0))
    return d
