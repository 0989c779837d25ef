"""Pre-normalization of the spectral approximations (geometry field ``prenormalize``).

Per matrix of a (..., m, n) tensor (norms over the last two dims): ``frobenius`` D/(‖D‖_F + ε),
``max`` D/max(‖D‖_F, ε) (torch.optim.Muon), ``aol`` S·D with S = diag(max(Σⱼ|A_ij|, ε))^(−1/2) from
the smaller Gram matrix A (:func:`aol`), ``none``. ``None`` means the default
(:func:`default_prenormalize`): frobenius with ε = 1e-7 for the polynomial iterations
(newton_schulz, gram_newton_schulz, polar_express: they diverge without it), none for svd and
gram_eigh. The polynomial iterations fold it into their small factors (:func:`prenorm_factor`,
:func:`aol_factors`).
"""

from __future__ import annotations

import torch

from geomopt.geometry.reference import working_eps
from geomopt.spec.geometries import POLYNOMIAL_APPROX_KINDS, FrobeniusPrenorm, MaxPrenorm, NoPrenorm, Prenormalize

#: ε of a pre-normalization that has none (``none``): the spec model's default (1e-7)
_EPS: float = FrobeniusPrenorm.model_fields["eps"].default
_ON, _OFF = FrobeniusPrenorm(), NoPrenorm()


def default_prenormalize(approx_kind: str) -> Prenormalize:
    """Pre-normalization (module docstring): on (frobenius, the spec model's ε) for the polynomial
    iterations, off otherwise, as :func:`geomopt.spec.model.effective_prenormalize` says."""
    return _ON if approx_kind in POLYNOMIAL_APPROX_KINDS else _OFF


def _eps(cfg: Prenormalize) -> float:
    """The ε of a pre-normalization (the spec model's default for ``none``, which has none)."""
    return _EPS if isinstance(cfg, NoPrenorm) else float(cfg.eps)


def prenormalize(x: torch.Tensor, cfg: Prenormalize | None, approx_kind: str = "svd",
                 inplace: bool = False) -> torch.Tensor:
    """Scale each matrix of ``x`` (..., m, n): ``frobenius`` D/(‖D‖_F + ε) (Muon reference code,
    Scion, paper eq. (4.1)), ``max`` D/max(‖D‖_F, ε) (torch.optim.Muon), ``aol`` S·D (:func:`aol`;
    tall matrices D·S, from DᵀD; a new tensor), ``none``. ``cfg`` None
    selects :func:`default_prenormalize`. ``inplace``: divide ``x`` itself (a scratch copy)."""
    cfg = default_prenormalize(approx_kind) if cfg is None else cfg
    if cfg.kind == "none":
        return x
    if cfg.kind == "aol":
        tall = x.shape[-2] > x.shape[-1]
        scaled = aol(x.mT if tall else x, cfg)[0]
        return scaled.mT if tall else scaled
    denom = _prenorm_denominator(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), cfg)
    return x.div_(denom) if inplace else torch.div(x, denom)


def _prenorm_denominator(norm: torch.Tensor, cfg: Prenormalize) -> torch.Tensor:
    """What :func:`prenormalize` divides a matrix by, from its ‖D‖_F (cfg kind frobenius or max)."""
    kind = cfg.kind
    # ε as the norm's dtype holds it, floored at √tiny (geomopt.geometry.reference.working_eps): an
    # ε that rounds to 0 would divide a zero matrix by 0, and one below √tiny would blow up a matrix
    # whose norm lost its entries' squares; ε past the dtype's range is +∞ (the matrix maps to 0)
    eps = working_eps(_eps(cfg), norm.dtype, norm=True)
    if isinstance(cfg, FrobeniusPrenorm):
        return norm + eps
    if isinstance(cfg, MaxPrenorm):
        return norm.clamp(min=eps)
    raise ValueError(f"unknown prenormalize kind {kind!r}; expected frobenius, max or none")


def by_norm(cfg: Prenormalize) -> bool:
    """Whether the pre-normalization multiplies each matrix by one factor of its ‖D‖²_F alone
    (frobenius, max: :func:`prenorm_factor`), a factor the folded iteration's first small factor
    can carry (:func:`geomopt.geometry.polynomial.first_factor_into`)."""
    return isinstance(cfg, (FrobeniusPrenorm, MaxPrenorm))


def prenorm_factor(sq_norm: torch.Tensor, cfg: Prenormalize) -> torch.Tensor | None:
    """The factor :func:`prenormalize` multiplies a matrix by, from its ‖D‖²_F (None for ``none``)."""
    if cfg.kind == "none":
        return None
    return _prenorm_denominator(sq_norm.sqrt(), cfg).reciprocal()


def aol_factors(gram: torch.Tensor, cfg: Prenormalize) -> torch.Tensor:
    """AOL's diagonal s (..., k) of S = diag(s) from a batch of Gram matrices A = DDᵀ (..., k, k):
    s_i = max(Σⱼ |A_ij|, ε)^(−1/2) (Prach & Lampert 2022, Theorem 1; ε floored at the dtype's tiny,
    summed in A's dtype, as Turbo-Muon does). Then ‖S·D‖₂ ≤ 1: for any x,
    xᵀSASx ≤ Σᵢⱼ |A_ij|·|sᵢxᵢ|·|sⱼxⱼ| ≤ Σᵢⱼ |A_ij|·(sᵢ²xᵢ² + sⱼ²xⱼ²)/2 = Σᵢ sᵢ²xᵢ²·Σⱼ|A_ij| ≤ ‖x‖²."""
    eps = working_eps(_eps(cfg), gram.dtype)
    return torch.rsqrt(torch.clamp_min(gram.abs().sum(dim=-1), eps))


def aol_gram(gram: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """S·A·S, the Gram matrix of S·D, from A (..., k, k) and s (..., k) (:func:`aol_factors`), in
    place: the first Newton–Schulz step reuses it instead of forming (S·D)(S·D)ᵀ again. Where A
    overflowed (entries of D past √max), s is 0 and ∞·0 is NaN: those entries are 0, as they are in
    S·D (a finite D's rows, or columns, scaled by 0)."""
    gram.mul_(s.unsqueeze(-1)).mul_(s.unsqueeze(-2))
    return torch.nan_to_num_(gram, nan=0.0, posinf=0.0, neginf=0.0)


def aol(x: torch.Tensor, cfg: Prenormalize) -> tuple[torch.Tensor, torch.Tensor]:
    """(S·D, S·A·S) for the rows of each matrix of ``x`` (..., m, n), A = DDᵀ (:func:`aol_factors`;
    callers read tall matrices transposed): the AOL start of a polynomial iteration and its first
    Gram matrix. Turbo-Muon's op order (github.com/thib-s/flash-newton-schulz): A, s, D·s, A·s·sᵀ."""
    gram = x @ x.mT
    s = aol_factors(gram, cfg)
    return x * s.unsqueeze(-1), aol_gram(gram, s)
