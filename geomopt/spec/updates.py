"""Directions, schedules, post-stages and weight decay: the parts of a step around its geometry.

Pydantic models of the spec language, each kind discriminated on ``kind``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from geomopt.spec.base import PositiveFloat, Probability, SpecModel, kinds_of

# ---------------------------------------------------------------- directions and schedules


class NoDirection(SpecModel):
    """d = g."""

    kind: Literal["none"] = "none"


class Polyak(SpecModel):
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


class HeavyBall(SpecModel):
    """torch.optim.SGD's momentum: b⁰ = g⁰, then b ← μb + (1−τ)g; d = b, or g + μb with
    ``nesterov`` (τ = ``dampening``)."""

    kind: Literal["heavy_ball"] = "heavy_ball"
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    dampening: Annotated[float, Field(ge=0, le=1)] = 0.0
    nesterov: bool = False


class Lion(SpecModel):
    """Lion's direction (Chen et al. 2023): d = β₁m + (1−β₁)g, then m ← β₂m + (1−β₂)g; m⁰ = 0.
    The sign is the geometry's (anisotropic with the indicator reference)."""

    kind: Literal["lion"] = "lion"
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.99


class Storm(SpecModel):
    """d ← g(x_k) + (1−α)(d − g(x_{k−1})) on the same batch; needs ``step(closure)``."""

    kind: Literal["storm"] = "storm"
    alpha: Probability = 0.1


class Dion(SpecModel):
    """Dion (Ahn et al. 2025, "Dion: Distributed Orthonormalized Updates", arXiv:2504.05295,
    Algorithm 1; microsoft/dion, dion/dion_simple.py): a rank-r power iteration on the momentum
    with error feedback. Per matrix (m×n, the tensor as (shape[0], rest)), state M (m×n, M⁰ = 0)
    and Q (n×r): B = M + G, P = orth(BQ) (QR), R = BᵀP, M ← B − (1−μ)PRᵀ, Q ← R/(‖R_{:,j}‖ + ε)
    column by column, d = √(m/n)·PQᵀ (Dion's shape scale, so the geometry is ``euclidean``).
    ``rank``: an int r ≥ 1, or a fraction in (0, 1] of min(m, n), rounded up (1.0: full rank)."""

    kind: Literal["dion"] = "dion"
    rank: Union[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0, le=1)]] = 0.25
    mu: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8

    @field_validator("rank", mode="wrap")
    @classmethod
    def _rank_is_int_or_fraction(cls, v, handler):
        """One message for the two forms (the union's would name only the int's)."""
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("rank must be an int ≥ 1 or a fraction of min(m, n) in (0, 1]") from None


Direction = Annotated[Union[NoDirection, Polyak, HeavyBall, Lion, Storm, Dion], Field(discriminator="kind")]
DIRECTION_KINDS = kinds_of(Direction)


class ConstantSchedule(SpecModel):
    kind: Literal["constant"] = "constant"


class TheorySchedule(SpecModel):
    """γ = γ̄(K+1)^(−3/4), α = (K+1)^(−1/2) (Theorem 4.3)."""

    kind: Literal["theory"] = "theory"
    horizon: Annotated[int, Field(ge=1)]
    gamma_bar: PositiveFloat


class StormSchedule(SpecModel):
    """α_k = γ_k = (k+1)^(−2/3) (Theorem 4.5)."""

    kind: Literal["storm"] = "storm"


Schedule = Annotated[Union[ConstantSchedule, TheorySchedule, StormSchedule], Field(discriminator="kind")]

# ---------------------------------------------------------------- post-stages and weight decay


class Contra(SpecModel):
    """U ← (1 + c)·U − c·D/σ₁(D) per matrix, D the direction, σ₁ by ``power_steps`` power
    iterations from the all-ones vector: Contra-Muon (Nilin 2026, github.com/nilin/contra-muon),
    Muon's update pushed past the polar factor, damping the top singular directions. Its first
    code (modded-nanogpt PR #275) subtracts a fraction f of D/σ₁ and restores ‖U‖_F: ``coeff``
    f/(1 − f), then ``rms_match`` target input."""

    kind: Literal["contra"] = "contra"
    coeff: Annotated[float, Field(gt=0, le=1)] = 0.25
    power_steps: Annotated[int, Field(ge=1, le=100)] = 5


class SecondMoment(SpecModel):
    """Normalize the preconditioned update U by a running second moment of it: v ← β₂v +
    (1−β₂)·mean(U²) over each row (``axis: row``, NorMuon), each column (``column``), each row or
    column of the matrix's longer side (``longer``: rows where there are at least as many rows as
    columns, else columns; modded-nanogpt's NorMuonH) or per entry (``element``, AdaMuon);
    U ← U/(√(v/c) + ε), c = 1 − β₂ᵗ with ``bias_correction`` else 1."""

    kind: Literal["second_moment"] = "second_moment"
    axis: Literal["row", "column", "longer", "element"] = "row"
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    bias_correction: bool = False


class AxisNorm(SpecModel):
    """U ← U/√(Σ U² + ε) over each row (``row``) or column (``column``) of the view's matrices, in the
    listed order (one or both): unit rows or columns, no state. Muon+ (Zhang et al. 2026,
    arXiv:2602.21545): one normalization after the orthogonalization (``[row, column]``: its
    ``row_col``)."""

    kind: Literal["axis_norm"] = "axis_norm"
    order: Annotated[list[Literal["row", "column"]], Field(min_length=1, max_length=2)] = ["row"]
    eps: PositiveFloat = 1e-7

    @field_validator("order")
    @classmethod
    def _distinct(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"order lists each axis at most once, got {v}")
        return v


class DualScale(SpecModel):
    """U ← ⟨U, D⟩·U per tensor: for the exact lmo U of a norm, ⟨U, D⟩ = ‖D‖_* and the step is
    steepest descent in that norm (PolarGrad's nuclear-norm-scaled polar step for spectral)."""

    kind: Literal["dual_scale"] = "dual_scale"


class NormRatio(SpecModel):
    """U ← U·‖D‖_F/(√v + ε) per tensor, v ← β₂v + (1−β₂)‖G‖²_F (v⁰ = 0; D the direction, G the
    gradient): NAMO's norm-adaptive scale of the orthogonalized momentum (arXiv:2602.17080)."""

    kind: Literal["norm_ratio"] = "norm_ratio"
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8


class RmsMatch(SpecModel):
    """U ← U·t·√n/(‖U‖_F + ε) per tensor of n entries: RMS t (0.2: Moonlight's AdamW-matched
    scale), ``input`` (the RMS U had when the geometry gave it: NorMuon's preserved norm),
    ``polar`` (the RMS of a semi-orthogonal matrix of the tensor's view: AdaMuon) or ``unit``
    (Frobenius norm 1, so the rule's radius ρ sets the step's norm: hyperball Muon)."""

    kind: Literal["rms_match"] = "rms_match"
    target: Union[PositiveFloat, Literal["input", "polar", "unit"]] = 0.2
    eps: PositiveFloat = 1e-8


class Cautious(SpecModel):
    """Cautious masking (Liang et al. 2024): U ← U⊙m·n/(Σm + 1), m = [U⊙G > 0], G the
    gradient: components whose sign disagrees with the gradient are dropped, the rest rescaled."""

    kind: Literal["cautious"] = "cautious"


class TrustRatio(SpecModel):
    """U ← r·W, W = U + λX, r = η·min(‖X‖_F, c)/(N + ε) per tensor (r = 1 where ‖X‖ or N is 0),
    N = ‖U‖_F + λ‖X‖_F (``denominator: sum``: LARS, You et al. 2017) or ‖W‖_F (``update``: LAMB,
    You et al. 2020), X the parameter before the step: each tensor's step sized by its weight's
    norm. λ = ``weight_decay`` is the papers' decay, inside the ratio (the rule's own decoupled
    decay, X(1 − γλ) after the stages, is another optimizer's; leave it 0 for LARS and LAMB);
    η = ``coeff``, c = ``clamp`` (none by default)."""

    kind: Literal["trust_ratio"] = "trust_ratio"
    coeff: PositiveFloat = 1.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    denominator: Literal["sum", "update"] = "update"
    eps: Annotated[float, Field(ge=0)] = 0.0
    clamp: Optional[PositiveFloat] = None


PostStage = Annotated[Union[Contra, SecondMoment, AxisNorm, DualScale, NormRatio, RmsMatch, Cautious, TrustRatio],
                      Field(discriminator="kind")]
#: the order post-stages run in (and must be listed in; the union's order), each at most once
STAGE_ORDER = kinds_of(PostStage)


class DecoupledDecay(SpecModel):
    """X ← X − γλX (AdamW's decoupled weight decay, torch's form X(1 − γλ))."""

    kind: Literal["decoupled"] = "decoupled"


class CautiousDecay(SpecModel):
    """X ← X − γλ·[S⊙X ≥ 0]⊙X, S the step: decay only where the update and the weight agree in
    sign (Chen et al. 2025, cautious weight decay)."""

    kind: Literal["cautious"] = "cautious"


Decay = Annotated[Union[DecoupledDecay, CautiousDecay], Field(discriminator="kind")]


class MaxLogitClip(SpecModel):
    """QK-clip (Kimi K2's MuonClip, arXiv 2507.20534 §2.1): after each step, every attention head h
    whose largest pre-softmax logit S_h = max_{i,j} q_i·k_j·scale over the forwards since the
    previous step exceeded ``tau`` has its query rows scaled by η_h^α and its key rows by
    η_h^(1−α), η_h = τ / S_h (α = ``alpha``, 0.5 in the report), so S_h becomes τ (a key head
    shared by several query heads, grouped-query attention, takes its group's smallest η). The
    logits come from ``geomopt.monitor_attention(model)`` (:mod:`geomopt.monitor`); the step is
    :mod:`geomopt.optim.engine.qkclip`. The rule's tensors must be query/key projections."""

    kind: Literal["max_logit"] = "max_logit"
    tau: PositiveFloat
    alpha: Annotated[float, Field(ge=0, le=1)] = 0.5
