"""Constraints g: the sets a rule's step is projected onto, and the proximal decay.

Pydantic models of the spec language, each kind discriminated on ``kind``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from geomopt.spec.base import PositiveFloat, SpecModel, kinds_of

# ---------------------------------------------------------------- constraints g


class _Radius(SpecModel):
    """``relative: true`` measures ``radius`` in units of the geometry's resolved radius ρ (its
    lmo radius, scale preset included), e.g. the paper's Frobenius ball at half the lmo radius."""

    radius: PositiveFloat = 1.0
    relative: bool = False


class L2Ball(_Radius):
    kind: Literal["l2_ball"] = "l2_ball"


class LinfBall(_Radius):
    kind: Literal["linf_ball"] = "linf_ball"


class LinfSphere(_Radius):
    kind: Literal["linf_sphere"] = "linf_sphere"


class SignSet(_Radius):
    kind: Literal["sign_set"] = "sign_set"


class FrobeniusBall(_Radius):
    kind: Literal["frobenius_ball"] = "frobenius_ball"


class FrobeniusSphere(_Radius):
    """``method: project`` replaces the backward step in the rule's geometry by the Euclidean
    projection X⁺ = r·Y/‖Y‖_F, whatever the geometry (a retraction: hyperball Muon's
    W ← R·normalize(W − lr·R·normalize(U)), NVIDIA Emerging-Optimizers' MuonHyperball)."""

    kind: Literal["frobenius_sphere"] = "frobenius_sphere"
    method: Annotated[Literal["prox", "project"], Field(description=(
        "prox (the default): the backward step in the rule's geometry. project: the Euclidean projection "
        "r*Y/||Y||_F whatever the geometry, a retraction (hyperball Muon)."))] = "prox"


#: the ``method`` of spectral_ball and stiefel (geomopt.geometry.method resolves ``auto`` where the
#: step runs; this module stays torch-free, so the rule is spelled out here too)
_METHOD_DESCRIPTION = (
    "How the backward step is computed. exact: diagonalize the small Gram matrix (batched eigh; "
    "the SVD where that is not as accurate). polar: SVD-free polar iterations, matrix products "
    "only (approximate: max-entry error <= 2e-6*r in fp32 on training's steps). auto (the "
    "default): chosen per bucket where the step runs, exact on CPU, polar on CUDA where the "
    "smaller matrix side > 32 (larger matrices leave cuSOLVER's batched eigh for a per-matrix "
    "loop), exact otherwise. exact and polar force one.")

Method = Annotated[Literal["auto", "exact", "polar"], Field(description=_METHOD_DESCRIPTION)]


class SpectralBall(_Radius):
    """``method: polar`` clips singular values from two polar factors, SVD-free (approximate);
    ``auto`` (the default) picks exact or polar by device and matrix size."""

    kind: Literal["spectral_ball"] = "spectral_ball"
    method: Method = "auto"


class SpectralSphere(_Radius):
    kind: Literal["spectral_sphere"] = "spectral_sphere"


_STIEFEL_METHOD_DESCRIPTION = (
    _METHOD_DESCRIPTION + " msign (stiefel only, under a spectral geometry): X = r·msign(Y) by the rule's own "
    "spectral approximation (its Newton-Schulz or Polar Express iteration, as the forward step runs it), a "
    "retraction rather than the projection: with Muon's quintic the singular values land near r, not on it "
    "(SPEL's outer msign); project_on_init still projects exactly.")


class Stiefel(_Radius):
    """``method: polar`` normalizes by r + t and runs a convergent polar iteration (approximate);
    ``auto`` (the default) picks exact or polar by device and matrix size; ``msign`` retracts by the
    rule's spectral approximation, X⁺ = r·msign(Y) (SPEL, arXiv:2601.21487)."""

    kind: Literal["stiefel"] = "stiefel"
    method: Annotated[Literal["auto", "exact", "polar", "msign"],
                      Field(description=_STIEFEL_METHOD_DESCRIPTION)] = "auto"


class L0(SpecModel):
    kind: Literal["l0"] = "l0"
    k: Annotated[int, Field(ge=1)]


class Rank(SpecModel):
    kind: Literal["rank"] = "rank"
    k: Annotated[int, Field(ge=1)]


class ProximalDecay(SpecModel):
    """g = (1/λ)⋆φ: X⁺ = Y/(1+γλ) (Remark 2.5)."""

    kind: Literal["proximal_decay"] = "proximal_decay"
    lam: PositiveFloat


Constraint = Annotated[
    Union[
        L2Ball, LinfBall, LinfSphere, SignSet, FrobeniusBall, FrobeniusSphere, SpectralBall, SpectralSphere,
        Stiefel, L0, Rank, ProximalDecay,
    ],
    Field(discriminator="kind"),
]
CONSTRAINT_KINDS = kinds_of(Constraint)
