"""The spec language as pydantic v2 models (strict, ``extra="forbid"``).

Every kind is a discriminated union on ``kind``; field names here are the contract that YAML, the
DSL, the JSON Schema and the operators in :mod:`geomopt.geometry` (which receive
``model_dump()`` dicts of these models) all share.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(gt=0, le=1)]


class _Model(BaseModel):
    # allow_inf_nan=False: no field means anything at ±inf/nan, and the DSL has no spelling for them
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


# ---------------------------------------------------------------- reference functions h


class LogBarrier(_Model):
    """h(x) = −ε(ln(1−|x|)+|x|); (h*)'(y) = y/(ε+|y|)."""

    kind: Literal["log_barrier"] = "log_barrier"
    eps: PositiveFloat = 1e-8


class PowerBarrier(_Model):
    """h'(x) = εx/(1−|x|^κ)^{1/κ}; (h*)'(y) = y/(ε^κ+|y|^κ)^{1/κ}."""

    kind: Literal["power_barrier"] = "power_barrier"
    kappa: Annotated[float, Field(ge=1)] = 4.0
    eps: PositiveFloat = 1e-3


class Indicator(_Model):
    """h = δ_[−1,1], the ε→0 limit: (h*)' = sign (the lmo)."""

    kind: Literal["indicator"] = "indicator"


class Quadratic(_Model):
    """h(x) = x²/2: the Euclidean reference."""

    kind: Literal["quadratic"] = "quadratic"


Reference = Annotated[Union[LogBarrier, PowerBarrier, Indicator, Quadratic], Field(discriminator="kind")]

# ---------------------------------------------------------------- spectral approximations

ApproxDtype = Literal["auto", "float32", "bfloat16", "float64"]
Triple = Annotated[list[float], Field(min_length=3, max_length=3)]


class Svd(_Model):
    """Exact: U·Diag((h*)'(σ))·Vᵀ from torch.linalg.svd."""

    kind: Literal["svd"] = "svd"
    dtype: ApproxDtype = "auto"


class GramEigh(_Model):
    """Exact in float64: eigh of the Gram matrix DᵀD (or DDᵀ)."""

    kind: Literal["gram_eigh"] = "gram_eigh"
    dtype: ApproxDtype = "auto"


def _fit_steps(v, info):
    """A per-step coefficient list holds one triple (for every step) or one per step."""
    steps = info.data.get("steps")
    if v is not None and steps is not None and len(v) not in (1, steps):
        raise ValueError(f"coefficients must hold 1 or steps={steps} triples, got {len(v)}")
    return v


class NewtonSchulz(_Model):
    """Quintic Newton–Schulz, X ← aX + b(XXᵀ)X + c(XXᵀ)²X; default Muon's (3.4445, −4.7750, 2.0315)."""

    kind: Literal["newton_schulz"] = "newton_schulz"
    steps: Annotated[int, Field(ge=1, le=100)] = 5
    coefficients: Optional[list[Triple]] = None
    dtype: ApproxDtype = "auto"

    # a field validator (steps is validated first), so errors point at the field
    _coefficients_fit_steps = field_validator("coefficients")(_fit_steps)


class PolarExpress(_Model):
    """Polar Express: per-step quintic coefficients ("polar_express": the authors' list with its
    1.01 safety factor; "speedrun": the 5-step speedrun list; or a user list of triples)."""

    kind: Literal["polar_express"] = "polar_express"
    steps: Annotated[int, Field(ge=1, le=100)] = 5
    coefficients: Union[Literal["polar_express", "speedrun"], list[Triple]] = "polar_express"
    dtype: ApproxDtype = "auto"

    @field_validator("coefficients")
    @classmethod
    def _coefficients_not_empty(cls, v):
        if isinstance(v, list) and len(v) < 1:
            raise ValueError("coefficients must hold at least one triple")
        return v


class GramNewtonSchulz(_Model):
    """Newton–Schulz's quintic run on the small Gram side (restarted Gram Newton–Schulz, Dao AI Lab
    2026, as in microsoft/dion): for X (m×n, m ≤ n) a step is X ← Q·X, Q = aI + bA + cA², A = XXᵀ,
    so only the m×m matrices R (X = R·X₀) and A ← QAQ are iterated; X = R·X₀ is formed at the end
    and after each step listed in ``restarts`` (where A is recomputed from it and R reset), for
    stability. The same map as newton_schulz (same ``steps`` and ``coefficients``) in fewer FLOPs
    where m ≪ n. ``restarts``: step numbers 1 … steps−1; the default [2] restarts after step 2
    where there is a step 3 (nothing where steps ≤ 2)."""

    kind: Literal["gram_newton_schulz"] = "gram_newton_schulz"
    steps: Annotated[int, Field(ge=1, le=100)] = 5
    coefficients: Optional[list[Triple]] = None
    restarts: list[Annotated[int, Field(ge=1)]] = [2]
    dtype: ApproxDtype = "auto"

    _coefficients_fit_steps = field_validator("coefficients")(_fit_steps)

    @field_validator("restarts")  # only given values: the default [2] is validated for no step count
    @classmethod
    def _restarts_within_steps(cls, v, info):
        steps = info.data.get("steps")
        bad = [r for r in v if steps is not None and r >= steps]
        if bad:
            raise ValueError(f"restarts must be step numbers below steps={steps} (X is formed after the last step "
                             f"anyway), got {bad[0]}")
        if len(set(v)) != len(v):
            raise ValueError(f"restarts must be distinct, got {v}")
        return v


Approx = Annotated[Union[Svd, GramEigh, NewtonSchulz, GramNewtonSchulz, PolarExpress], Field(discriminator="kind")]

#: The approximations that are matrix polynomial iterations: they realize their own map (the κ = 4
#: power barrier), pre-normalize by default, run in bf16 on CUDA (geomopt.geometry.spectral); svd
#: and gram_eigh are exact factorizations.
POLYNOMIAL_APPROX_KINDS = ("newton_schulz", "gram_newton_schulz", "polar_express")

# ---------------------------------------------------------------- pre-normalization


class FrobeniusPrenorm(_Model):
    """D ← D/(‖D‖_F + ε) (Muon reference code, Scion)."""

    kind: Literal["frobenius"] = "frobenius"
    eps: PositiveFloat = 1e-7


class MaxPrenorm(_Model):
    """D ← D/max(‖D‖_F, ε) (torch.optim.Muon)."""

    kind: Literal["max"] = "max"
    eps: PositiveFloat = 1e-7


class NoPrenorm(_Model):
    """No pre-normalization (the default for svd and gram_eigh)."""

    kind: Literal["none"] = "none"


Prenormalize = Annotated[Union[FrobeniusPrenorm, MaxPrenorm, NoPrenorm], Field(discriminator="kind")]

# ---------------------------------------------------------------- geometries

Scale = Literal["none", "scion", "muon_original", "match_rms_adamw"]
Layout = Literal["auto", "out_in", "in_out"]  # auto: in_out for Hugging Face Conv1D, else out_in


class AutoView(_Model):
    """The matrices the tensor's structure says it holds (:mod:`geomopt.compile.roles`): each
    expert of a batched (E, out, in) expert weight, each block of a fused projection (q, k, v;
    gate, up), a conv kernel as out × in·kh·kw; a plain (out, in) matrix otherwise."""

    kind: Literal["auto"] = "auto"


class MatrixView(_Model):
    """How a tensor is read as a batch of matrices. ``batch``: leading axes that index separate
    matrices (MoE experts: 1). The next axis is the rows; the axes after it are the columns
    (``trailing: cols``, conv: out × in·kh·kw), or the first of them is and the rest index
    separate matrices (``trailing: batch``, conv: one out × in matrix per kernel position).
    ``blocks``: the rows cut into k equal blocks, or into blocks of the given sizes, each its own
    matrix (heads, fused q,k,v under grouped-query attention, fused [gate, up])."""

    kind: Literal["matrix"] = "matrix"
    batch: Annotated[int, Field(ge=0)] = 0
    trailing: Literal["cols", "batch"] = "cols"
    blocks: Optional[Union[Annotated[int, Field(ge=1)], Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]]] = None


View = Annotated[Union[AutoView, MatrixView], Field(discriminator="kind")]
VIEW_KINDS = ("auto", "matrix")

# Fields whose value is a {kind: …} mapping: a bare word there (DSL) names the kind.
KIND_FIELDS = frozenset({"geometry", "constraint", "reference", "approx", "prenormalize", "direction", "schedule", "view",
                         "decay", "post"})


def _view_shorthand(v):
    """``view: auto`` is shorthand for ``view: {kind: auto}``."""
    return {"kind": v} if isinstance(v, str) else v


class _Geometry(_Model):
    radius: PositiveFloat = 1.0


class _MatrixGeometry(_Geometry):
    view: Optional[View] = None

    @field_validator("view", mode="before")
    @classmethod
    def _view_shorthand(cls, v):
        return _view_shorthand(v)


class Euclidean(_Geometry):
    """φ = ½‖·‖²: ∇φ*(D) = D (SGD)."""

    kind: Literal["euclidean"] = "euclidean"


class Isotropic(_Geometry):
    """∇φ*(D) = (h*)'(‖D‖_F)·D/‖D‖_F (normalized gradient)."""

    kind: Literal["isotropic"] = "isotropic"
    reference: Reference
    scale: Scale = "none"


class Anisotropic(_MatrixGeometry):
    """∇φ*(D) = (h*)'(D_ij) elementwise (sign-like)."""

    kind: Literal["anisotropic"] = "anisotropic"
    reference: Reference
    scale: Scale = "none"
    layout: Layout = "auto"


class Spectral(_MatrixGeometry):
    """∇φ*(D) = U·Diag((h*)'(σ_i))·Vᵀ per matrix of the tensor's ``view`` (default: the
    (shape[0], rest) matrix)."""

    kind: Literal["spectral"] = "spectral"
    reference: Reference
    approx: Approx = Field(default_factory=Svd)
    prenormalize: Optional[Prenormalize] = None
    scale: Scale = "none"
    layout: Layout = "auto"


class Rowwise(_MatrixGeometry):
    """Isotropic per row (Scion RowNorm)."""

    kind: Literal["rowwise"] = "rowwise"
    reference: Reference
    scale: Scale = "none"
    layout: Layout = "auto"


class Columnwise(_MatrixGeometry):
    """Isotropic per column (Scion ColNorm)."""

    kind: Literal["columnwise"] = "columnwise"
    reference: Reference
    scale: Scale = "none"
    layout: Layout = "auto"


class Adam(_Geometry):
    """Adam(W)'s update as a state-carrying forward op: outside the paper's theory."""

    kind: Literal["adam"] = "adam"
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.999]
    eps: PositiveFloat = 1e-8


Geometry = Annotated[
    Union[Euclidean, Isotropic, Anisotropic, Spectral, Rowwise, Columnwise, Adam], Field(discriminator="kind")
]
GEOMETRY_KINDS = ("euclidean", "isotropic", "anisotropic", "spectral", "rowwise", "columnwise", "adam")

# ---------------------------------------------------------------- constraints g


class _Radius(_Model):
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
    kind: Literal["frobenius_sphere"] = "frobenius_sphere"


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


class Stiefel(_Radius):
    """``method: polar`` normalizes by r + t and runs a convergent polar iteration (approximate);
    ``auto`` (the default) picks exact or polar by device and matrix size."""

    kind: Literal["stiefel"] = "stiefel"
    method: Method = "auto"


class L0(_Model):
    kind: Literal["l0"] = "l0"
    k: Annotated[int, Field(ge=1)]


class Rank(_Model):
    kind: Literal["rank"] = "rank"
    k: Annotated[int, Field(ge=1)]


class ProximalDecay(_Model):
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
CONSTRAINT_KINDS = (
    "l2_ball", "linf_ball", "linf_sphere", "sign_set", "frobenius_ball", "frobenius_sphere", "spectral_ball",
    "spectral_sphere", "stiefel", "l0", "rank", "proximal_decay",
)

# ---------------------------------------------------------------- directions and schedules


class NoDirection(_Model):
    """d = g."""

    kind: Literal["none"] = "none"


class Polyak(_Model):
    """d ← αg + (1−α)d (β = 1 − α in Muon's terms); d⁰ = 0, or g⁰ with ``init: gradient``.
    Momentum warmup: α moves linearly from ``warmup_alpha`` at step 0 to ``alpha`` at step
    ``warmup_steps`` (Muon's β from 0.85 to 0.95 over 300 steps: ``alpha: 0.05, warmup_steps:
    300, warmup_alpha: 0.15``)."""

    kind: Literal["polyak"] = "polyak"
    alpha: Probability = 0.1
    nesterov: bool = False
    init: Literal["zero", "gradient"] = "zero"
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    warmup_alpha: Optional[Probability] = None

    @model_validator(mode="after")
    def _warmup_complete(self):
        if (self.warmup_steps > 0) != (self.warmup_alpha is not None):
            raise ValueError("momentum warmup needs both warmup_steps (> 0) and warmup_alpha (α at step 0)")
        return self


class HeavyBall(_Model):
    """torch.optim.SGD's momentum: b⁰ = g⁰, then b ← μb + (1−τ)g; d = b, or g + μb with
    ``nesterov`` (τ = ``dampening``)."""

    kind: Literal["heavy_ball"] = "heavy_ball"
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    dampening: Annotated[float, Field(ge=0, le=1)] = 0.0
    nesterov: bool = False


class Lion(_Model):
    """Lion's direction (Chen et al. 2023): d = β₁m + (1−β₁)g, then m ← β₂m + (1−β₂)g; m⁰ = 0.
    The sign is the geometry's (anisotropic with the indicator reference)."""

    kind: Literal["lion"] = "lion"
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.99


class Storm(_Model):
    """d ← g(x_k) + (1−α)(d − g(x_{k−1})) on the same batch; needs ``step(closure)``."""

    kind: Literal["storm"] = "storm"
    alpha: Probability = 0.1


Direction = Annotated[Union[NoDirection, Polyak, HeavyBall, Lion, Storm], Field(discriminator="kind")]
DIRECTION_KINDS = ("none", "polyak", "heavy_ball", "lion", "storm")


class ConstantSchedule(_Model):
    kind: Literal["constant"] = "constant"


class TheorySchedule(_Model):
    """γ = γ̄(K+1)^(−3/4), α = (K+1)^(−1/2) (Theorem 4.3)."""

    kind: Literal["theory"] = "theory"
    horizon: Annotated[int, Field(ge=1)]
    gamma_bar: PositiveFloat


class StormSchedule(_Model):
    """α_k = γ_k = (k+1)^(−2/3) (Theorem 4.5)."""

    kind: Literal["storm"] = "storm"


Schedule = Annotated[Union[ConstantSchedule, TheorySchedule, StormSchedule], Field(discriminator="kind")]

# ---------------------------------------------------------------- post-stages and weight decay


class SecondMoment(_Model):
    """Normalize the preconditioned update U by a running second moment of it: v ← β₂v +
    (1−β₂)·mean(U²) over each row (``axis: row``, NorMuon), each column (``column``) or per
    entry (``element``, AdaMuon); U ← U/(√(v/c) + ε), c = 1 − β₂ᵗ with ``bias_correction`` else 1."""

    kind: Literal["second_moment"] = "second_moment"
    axis: Literal["row", "column", "element"] = "row"
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    bias_correction: bool = False


class DualScale(_Model):
    """U ← ⟨U, D⟩·U per tensor: for the exact lmo U of a norm, ⟨U, D⟩ = ‖D‖_* and the step is
    steepest descent in that norm (PolarGrad's nuclear-norm-scaled polar step for spectral)."""

    kind: Literal["dual_scale"] = "dual_scale"


class RmsMatch(_Model):
    """U ← U·t·√n/(‖U‖_F + ε) per tensor of n entries: RMS t (0.2: Moonlight's AdamW-matched
    scale), ``input`` (the RMS U had when the geometry gave it: NorMuon's preserved norm) or
    ``polar`` (the RMS of a semi-orthogonal matrix of the tensor's view: AdaMuon)."""

    kind: Literal["rms_match"] = "rms_match"
    target: Union[PositiveFloat, Literal["input", "polar"]] = 0.2
    eps: PositiveFloat = 1e-8


class Cautious(_Model):
    """Cautious masking (Liang et al. 2024): U ← U⊙m·n/(Σm + 1), m = [U⊙G > 0], G the
    gradient: components whose sign disagrees with the gradient are dropped, the rest rescaled."""

    kind: Literal["cautious"] = "cautious"


PostStage = Annotated[Union[SecondMoment, DualScale, RmsMatch, Cautious], Field(discriminator="kind")]
#: the order post-stages run in (and must be listed in); each at most once
STAGE_ORDER = ("second_moment", "dual_scale", "rms_match", "cautious")


class DecoupledDecay(_Model):
    """X ← X − γλX (AdamW's decoupled weight decay, torch's form X(1 − γλ))."""

    kind: Literal["decoupled"] = "decoupled"


class CautiousDecay(_Model):
    """X ← X − γλ·[S⊙X ≥ 0]⊙X, S the step: decay only where the update and the weight agree in
    sign (Chen et al. 2025, cautious weight decay)."""

    kind: Literal["cautious"] = "cautious"


Decay = Annotated[Union[DecoupledDecay, CautiousDecay], Field(discriminator="kind")]


# ---------------------------------------------------------------- matching, rules, spec

ShapeDim = Union[Annotated[int, Field(ge=0)], Literal["*"]]

#: What a tensor does in its model (:mod:`geomopt.compile.roles` infers it).
RoleName = Literal["embedding", "head", "router", "expert", "norm", "bias", "hidden", "other"]
ROLE_NAMES = ("embedding", "head", "router", "expert", "norm", "bias", "hidden", "other")


def _check_regex(pattern: str) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(f"bad regular expression {pattern[3:]!r}: {exc}") from None


class Match(_Model):
    """Which parameters a rule owns: every given predicate must hold.

    ``name``: glob on the dotted name (``*`` within a segment, ``**`` across) or ``re:`` full-match
    regex; ``module``: the owning module's class name (or a base class's); ``role``: what the tensor
    does in the model (one role or a list, :data:`ROLE_NAMES`); ``ndim`` (an int or a list of
    allowed ints); ``shape`` (ints or ``"*"``).
    """

    name: Optional[str] = None
    module: Optional[str] = None
    role: Optional[Union[RoleName, Annotated[list[RoleName], Field(min_length=1)]]] = None
    ndim: Optional[Union[Annotated[int, Field(ge=0)], Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]] = None
    shape: Optional[list[ShapeDim]] = None

    @field_validator("name")
    @classmethod
    def _pattern_compiles(cls, v):
        if v is None:
            return v
        if v == "":
            raise ValueError("empty name pattern; use '**' to match every parameter")
        _check_regex(v)
        return v

    @model_validator(mode="after")
    def _not_empty(self):
        if self.name is None and self.module is None and self.role is None and self.ndim is None and self.shape is None:
            raise ValueError("match needs at least one of name, module, role, ndim, shape")
        return self


_RULE_NAME = r"^[A-Za-z_][A-Za-z0-9_\-]*$"


class Hyper(_Model):
    """Hyper-parameters shared by ``defaults`` and each rule (a rule's value overrides the default)."""

    lr: Optional[Annotated[float, Field(ge=0)]] = None
    weight_decay: Optional[Annotated[float, Field(ge=0)]] = None
    direction: Optional[Direction] = None
    decay: Optional[Decay] = None
    schedule: Optional[Schedule] = None
    on_nonfinite: Optional[Literal["skip", "raise"]] = None
    project_on_init: Optional[bool] = None

    @field_validator("decay", mode="before")
    @classmethod
    def _decay_shorthand(cls, v):
        return _view_shorthand(v)


class Defaults(Hyper):
    """Spec-wide defaults; unset fields fall back to lr 0.02, weight_decay 0, direction none,
    decay decoupled, schedule constant, on_nonfinite skip, project_on_init true."""


class Rule(Hyper):
    """``post``: stages applied to the geometry's update, in :data:`STAGE_ORDER`; one step is
    direction → geometry → post-stages → weight decay → constraint."""

    name: Annotated[str, Field(pattern=_RULE_NAME)]
    match: Match
    geometry: Geometry
    post: Optional[Annotated[list[PostStage], Field(min_length=1)]] = None
    constraint: Optional[Constraint] = None

    @field_validator("match", mode="before")
    @classmethod
    def _match_shorthand(cls, v):
        return {"name": v} if isinstance(v, str) else v

    @field_validator("post", mode="before")
    @classmethod
    def _post_shorthand(cls, v):
        return [_view_shorthand(s) for s in v] if isinstance(v, list) else v

    @field_validator("post")
    @classmethod
    def _post_order(cls, v):
        if v is None:
            return v
        for i, (a, b) in enumerate(zip(v, v[1:])):
            if STAGE_ORDER.index(a.kind) >= STAGE_ORDER.index(b.kind):
                what = "appears twice" if a.kind == b.kind else f"must come before '{a.kind}'"
                raise PydanticCustomError(
                    "stage_order", "post-stage '{stage}' {what}: post-stages run once each, in the order {order}",
                    {"stage": b.kind, "what": what, "index": i + 1, "order": ", ".join(STAGE_ORDER)})
        return v


class Spec(_Model):
    """A whole spec: ordered rules, the first match owns a parameter. ``roles`` gives tensors a
    role by name pattern (glob or ``re:``), over what is inferred from the model."""

    geomopt: Literal[1]
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    defaults: Defaults = Field(default_factory=Defaults)
    roles: dict[RoleName, Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = Field(default_factory=dict)
    rules: Annotated[list[Rule], Field(min_length=1)]
    #: the spec this one was merged onto (geomopt.spec.extends: a shipped name or a path), as
    #: written; the other fields hold the merged result. Not in model_dump() (nor equality).
    extends: Optional[str] = Field(default=None, exclude=True, description=(
        "A spec to build on: a shipped spec's name (muon, scion, …) or a path (relative to this file). "
        "This spec's defaults and roles merge onto the base's, its rules override the base's rules of the "
        "same name or are added (before/after a base rule, or at the end); `remove: true` drops one."))
    _source: Any = PrivateAttr(default=None)  # positions, when parsed from text

    def __eq__(self, other) -> bool:  # equal content, wherever it was parsed from
        return isinstance(other, Spec) and self.model_dump() == other.model_dump()

    __hash__ = None

    @model_validator(mode="after")
    def _unique_rule_names(self):
        seen: dict = {}
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                # a custom error type carries the indices, so diagnostics can point at the second name
                raise PydanticCustomError(
                    "duplicate_rule_name", "duplicate rule name '{name}' (rules[{first}] has it too)",
                    {"name": rule.name, "index": i, "first": seen[rule.name]},
                )
            seen[rule.name] = i
        return self

    @field_validator("roles")
    @classmethod
    def _role_patterns_compile(cls, v):
        for patterns in v.values():
            for pattern in patterns:
                _check_regex(pattern)
        return v


RESOLVED_DEFAULTS = dict(
    lr=0.02, weight_decay=0.0, direction=NoDirection(), decay=DecoupledDecay(), schedule=ConstantSchedule(), on_nonfinite="skip",
    project_on_init=True,
)


def resolve_hyper(spec: Spec, rule: Rule) -> dict:
    """The effective hyper-parameters of ``rule``: rule value, else spec default, else built-in."""
    out = {}
    for key, builtin in RESOLVED_DEFAULTS.items():
        value = getattr(rule, key)
        if value is None:
            value = getattr(spec.defaults, key)
        out[key] = builtin if value is None else value
    return out


def effective_prenormalize(geometry: Spectral):
    """Newton–Schulz (plain or Gram) and Polar Express diverge without pre-normalization, so it
    defaults on (ε = 1e-7) for them (:data:`POLYNOMIAL_APPROX_KINDS`); off for svd and gram_eigh
    (geomopt.geometry.spectral: pre-normalization)."""
    if geometry.prenormalize is not None:
        return geometry.prenormalize
    if geometry.approx.kind in POLYNOMIAL_APPROX_KINDS:
        return FrobeniusPrenorm()
    return NoPrenorm()
