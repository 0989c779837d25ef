"""Pre-normalization of the spectral approximations (geometry field ``prenormalize``).

Per matrix of a (..., m, n) tensor (norms over the last two dims): ``frobenius`` D/(‖D‖_F + ε),
``max`` D/max(‖D‖_F, ε) (torch.optim.Muon), ``none``. ``None`` means the default
(:func:`default_prenormalize`): frobenius with ε = 1e-7 for the polynomial iterations
(newton_schulz, gram_newton_schulz, polar_express: they diverge without it), none for svd and
gram_eigh. The polynomial iterations fold it into their small factors (:func:`prenorm_factor`).
"""

from __future__ import annotations

import torch

from geomopt.geometry.reference import working_eps
from geomopt.spec.geometries import POLYNOMIAL_APPROX_KINDS, FrobeniusPrenorm, NoPrenorm
from geomopt.spec.base import Fields

#: ε of a pre-normalization fragment that leaves it out: the spec model's default (1e-7)
_EPS: float = FrobeniusPrenorm.model_fields["eps"].default


def default_prenormalize(approx_kind: str) -> dict:
    """Pre-normalization (module docstring): on (frobenius, the spec model's ε) for the polynomial
    iterations, off otherwise, as :func:`geomopt.spec.model.effective_prenormalize` says."""
    return (FrobeniusPrenorm() if approx_kind in POLYNOMIAL_APPROX_KINDS else NoPrenorm()).model_dump()


def prenormalize(x: torch.Tensor, cfg: Fields | None, approx_kind: str = "svd", inplace: bool = False) -> torch.Tensor:
    """Scale each matrix of ``x`` (..., m, n): ``frobenius`` D/(‖D‖_F + ε) (Muon reference code,
    Scion, paper eq. (4.1)), ``max`` D/max(‖D‖_F, ε) (torch.optim.Muon), ``none``. ``cfg`` None
    selects :func:`default_prenormalize`; a dict without ``kind`` means frobenius (the spec model's
    default). ``inplace``: divide ``x`` itself (a scratch copy)."""
    cfg = default_prenormalize(approx_kind) if cfg is None else cfg
    if cfg.get("kind", "frobenius") == "none":
        return x
    denom = _prenorm_denominator(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True), cfg)
    return x.div_(denom) if inplace else torch.div(x, denom)


def _prenorm_denominator(norm: torch.Tensor, cfg: Fields) -> torch.Tensor:
    """What :func:`prenormalize` divides a matrix by, from its ‖D‖_F (cfg kind frobenius or max)."""
    kind = cfg.get("kind", "frobenius")
    # ε as the norm's dtype holds it, floored at √tiny (geomopt.geometry.reference.working_eps): an
    # ε that rounds to 0 would divide a zero matrix by 0, and one below √tiny would blow up a matrix
    # whose norm lost its entries' squares; ε past the dtype's range is +∞ (the matrix maps to 0)
    eps = working_eps(float(cfg.get("eps", _EPS)), norm.dtype, norm=True)
    if kind == "frobenius":
        return norm + eps
    if kind == "max":
        return norm.clamp(min=eps)
    raise ValueError(f"unknown prenormalize kind {kind!r}; expected frobenius, max or none")


def prenorm_factor(sq_norm: torch.Tensor, cfg: Fields) -> torch.Tensor | None:
    """The factor :func:`prenormalize` multiplies a matrix by, from its ‖D‖²_F (None for ``none``)."""
    if cfg.get("kind", "frobenius") == "none":
        return None
    return _prenorm_denominator(sq_norm.sqrt(), cfg).reciprocal()
