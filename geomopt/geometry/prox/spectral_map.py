"""The spectral map of the exact backward steps: X = U·Diag(x)·Vᵀ for x = step(σ(M)), per matrix
of a batch (:func:`spectral_apply`).

It runs a batched eigh of the small Gram matrix where that is as accurate as an SVD (float32, or
float64 for the matrices that need it), and the SVD (:func:`_svd`, with LAPACK's completions and
the identity frame at M = 0) for the rest; the accepted matrices are composed as a low-rank
correction of c·M where that is cheaper (:func:`_gram_compose`). Used by the spectral rows of the
backward table and by the Euclidean projection onto spectral sets.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from geomopt.geometry.capture import refuse_in_capture
from geomopt.geometry.matrix import finite_or_zero


def _svd(m: torch.Tensor):
    """Reduced SVD with true singular-vector completions (LAPACK) and the identity frame at
    M = 0 (documented deterministic point for Stiefel and spheres); a matrix holding a NaN or ±∞
    gets NaN factors (:func:`~geomopt.geometry.matrix.finite_or_zero`), so its X is NaN."""
    m, nonfinite = finite_or_zero(m)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    q = s.shape[-1]
    zero = (s.amax(-1) == 0)[:, None, None]
    eye_u = torch.eye(m.shape[-2], q, dtype=m.dtype, device=m.device)
    eye_v = torch.eye(q, m.shape[-1], dtype=m.dtype, device=m.device)
    nan = torch.full((), math.nan, dtype=m.dtype, device=m.device)
    return (torch.where(nonfinite, nan, torch.where(zero, eye_u, u)), torch.where(nonfinite[..., 0], nan, s),
            torch.where(nonfinite, nan, torch.where(zero, eye_v, vh)))


def _compose(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    return (u * s.unsqueeze(-2)) @ vh


_GRAM_TOLERANCE = 8.0


class DeviceRoutes:
    """``with DeviceRoutes():`` :func:`spectral_apply` chooses each matrix's route on the device
    (a capturable step: no host synchronization): the float32 Gram–eigh where it is accurate, else
    the SVD, both computed for every matrix and selected per matrix (no float64 redo, no low-rank
    grouping). Same accuracy contract, about one SVD more per call."""

    active = False

    def __enter__(self):
        self.was, DeviceRoutes.active = DeviceRoutes.active, True
        return self

    def __exit__(self, *exc) -> None:
        DeviceRoutes.active = self.was


def spectral_apply(mats: torch.Tensor, step: Callable):
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
    underflow (‖M‖²_F below max(m, n)·tiny/u) or overflow (entries past √max). M = 0 keeps the identity frame of
    :func:`_svd`. Only the matrices that need it are redone, and only the accepted ones are composed
    (:func:`_gram_compose`); one host sync per call (the choice), one more per redo."""
    refuse_in_capture("torch.linalg.eigh and torch.linalg.svd")
    unit = torch.finfo(mats.dtype).eps  # the input's rounding (mats: the working dtype)
    x, extra, ratio, frame = _gram_eigh(mats, step, unit)
    if DeviceRoutes.active:
        gram = _gram_product(mats, x, frame, min(mats.shape[-2:]), frame[4])
        u, s, vh = _svd(mats)
        xs, extra_s = step(s)
        accurate = ratio <= _GRAM_TOLERANCE
        out = torch.where(accurate[:, None, None], gram, _compose(u, xs, vh))
        return out, None if extra is None else torch.where(accurate, extra, extra_s.to(extra.dtype))
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
    """The float64 Gram–eigh attempt of :func:`spectral_apply` on the matrices ``redo``: composed into
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
    assert values is not None  # step gives extra for every matrix or for none
    t = t.clone()
    t[rows] = values.to(t.dtype)
    return t


def _gram_eigh(work: torch.Tensor, step: Callable, unit: float):
    """One Gram–eigh attempt of :func:`spectral_apply` in ``work``'s dtype (``unit``: the input's
    rounding): (x, extra, R per matrix, frame) with frame = (V (eigh's ascending order),
    w (descending, as σ), c, width, zero): w is x/σ set to c = w at the smallest σ wherever x = c·σ
    to the rounding of x (where rounding alone separates them), width the number of leading σ where
    it is not, zero the flags of M = 0."""
    m, n = work.shape[-2:]
    dtype = work.dtype
    gram = work.mT @ work if m >= n else work @ work.mT
    # entries of M past √max (1.8e19 in float32), or a NaN or ±∞ in M, make G's diagonal non-finite:
    # eigh would raise on such a G, and also on the finite rest of it (a zero diagonal under large
    # entries does not converge), so the whole G is zeroed (the step is then computed by the SVD, below)
    overflow = ~torch.isfinite(gram.diagonal(dim1=-2, dim2=-1).sum(-1))
    gram = torch.where(overflow[:, None, None], 0, gram).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    lam, v = torch.linalg.eigh(gram)
    lam = lam.flip(-1).clamp(min=0)  # descending, as σ²
    trace = lam.sum(-1)  # ‖M‖²_F: below max(m, n)·tiny/u, G's products underflow beyond its rounding (SVD)
    zero = (trace == 0) & ~overflow
    small = (trace < max(m, n) * torch.finfo(dtype).tiny / torch.finfo(dtype).eps) | overflow
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
    # a lifted null direction: where λ is below G's own rounding (σ = 0 to the eigh's resolution; M·v
    # is noise there), x well above 0 and above what the resolved σ's largest w would give it (a
    # Stiefel step on a rank-deficient Y whose last σ is 1e-157; not a ball keeping a tiny σ as is)
    eps_g = torch.finfo(dtype).eps
    unresolved = lam <= 4 * eps_g * lam[:, :1]
    w_resolved = torch.where(unresolved, 0, w).amax(-1, keepdim=True)
    lifted = (unresolved & (x > 4 * eps_g * x.amax(-1, keepdim=True)) & (x > 2 * s * w_resolved)).any(-1)
    ratio = torch.where((tie.any(-1) | ((x > 0) & (s == 0)).any(-1) | small) & ~zero, math.inf, ratio)
    # lifted but σ > 0: a float64 Gram may resolve it (a finite R past the tolerance), else the SVD
    ratio = torch.where(lifted & ~zero, torch.clamp(ratio, min=1e30) if dtype != torch.float64 else math.inf,
                        ratio)
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


def _gram_product(mats: torch.Tensor, x: torch.Tensor, frame: tuple, k: int, zero) -> torch.Tensor:
    """:func:`_gram_compose` for one group: the low-rank form over the k leading directions (k < q),
    else the frame V·Diag(w)·Vᵀ; ``zero``: the flags of M = 0 (a list, or a device tensor)."""
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
    if isinstance(zero, torch.Tensor) or any(zero):
        diagonal = (torch.eye(m, n, dtype=mats.dtype, device=mats.device)
                    * torch.nn.functional.pad(x, (0, n - q))[:, None, :])
        flags = zero if isinstance(zero, torch.Tensor) else torch.tensor(zero, dtype=torch.bool, device=mats.device)
        out = torch.where(flags[:, None, None], diagonal, out)
    return out


def _max_slope(f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """max_k |f_k − f_{k+1}| / |x_k − x_{k+1}| per row (0 where f does not change; ∞ where it
    jumps between equal x)."""
    df, dx = (f[:, :-1] - f[:, 1:]).abs(), (x[:, :-1] - x[:, 1:]).abs()
    slope = torch.where(df == 0, 0, df / dx)
    return torch.cat([slope, slope.new_zeros(len(slope), 1)], -1).amax(-1)
