"""Geometries φ and their parts: references h, spectral approximations, pre-normalization, views.

Pydantic models of the spec language, each kind discriminated on ``kind``; the operators in
:mod:`geomopt.geometry` receive their ``model_dump()`` dicts.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from geomopt.spec.base import PositiveFloat, SpecModel, view_shorthand, kinds_of

# ---------------------------------------------------------------- reference functions h


class LogBarrier(SpecModel):
    """h(x) = −ε(ln(1−|x|)+|x|); (h*)'(y) = y/(ε+|y|)."""

    kind: Literal["log_barrier"] = "log_barrier"
    eps: PositiveFloat = 1e-8


class PowerBarrier(SpecModel):
    """h'(x) = εx/(1−|x|^κ)^{1/κ}; (h*)'(y) = y/(ε^κ+|y|^κ)^{1/κ}."""

    kind: Literal["power_barrier"] = "power_barrier"
    kappa: Annotated[float, Field(ge=1)] = 4.0
    eps: PositiveFloat = 1e-3


class Indicator(SpecModel):
    """h = δ_[−1,1], the ε→0 limit: (h*)' = sign (the lmo)."""

    kind: Literal["indicator"] = "indicator"


class Quadratic(SpecModel):
    """h(x) = x²/2: the Euclidean reference."""

    kind: Literal["quadratic"] = "quadratic"


Reference = Annotated[Union[LogBarrier, PowerBarrier, Indicator, Quadratic], Field(discriminator="kind")]

# ---------------------------------------------------------------- spectral approximations

ApproxDtype = Literal["auto", "float32", "bfloat16", "float64"]
Triple = Annotated[list[float], Field(min_length=3, max_length=3)]


class Svd(SpecModel):
    """Exact: U·Diag((h*)'(σ))·Vᵀ from torch.linalg.svd."""

    kind: Literal["svd"] = "svd"
    dtype: ApproxDtype = "auto"


class GramEigh(SpecModel):
    """Exact in float64: eigh of the Gram matrix DᵀD (or DDᵀ)."""

    kind: Literal["gram_eigh"] = "gram_eigh"
    dtype: ApproxDtype = "auto"


#: Named Newton–Schulz coefficient sets: NVIDIA Emerging-Optimizers' (``muon_utils._COEFFICIENT_SETS``,
#: as the package ships them; :data:`geomopt.support.NEWTON_SCHULZ_SETS` holds the triples)
NewtonSchulzSet = Literal["simple", "quintic", "polar_express", "cans", "aol"]


def _fit_steps(v, info):
    """A per-step coefficient list holds one triple (for every step) or one per step (a named set
    runs any number of steps: :func:`geomopt.support.newton_schulz_coefficients`)."""
    steps = info.data.get("steps")
    if isinstance(v, list) and steps is not None and len(v) not in (1, steps):
        raise ValueError(f"coefficients must hold 1 or steps={steps} triples, got {len(v)}")
    return v


class NewtonSchulz(SpecModel):
    """Quintic Newton–Schulz, X ← aX + b(XXᵀ)X + c(XXᵀ)²X; default Muon's (3.4445, −4.7750, 2.0315).
    ``coefficients``: one triple for every step, one per step, or a named set as NVIDIA
    Emerging-Optimizers ships it: ``simple`` (Muon's triple), ``quintic`` (modded-nanogpt's five),
    ``aol`` (Turbo-Muon's four, fitted to start from ``prenormalize: aol``), cycled past their end;
    ``polar_express`` (Amsel et al.'s eight with the 1.01 safety factor, to 4 decimals) and ``cans``
    (Grishina et al.'s five), whose last triple repeats."""

    kind: Literal["newton_schulz"] = "newton_schulz"
    steps: Annotated[int, Field(ge=1, le=100)] = 5
    coefficients: Optional[Union[NewtonSchulzSet, list[Triple]]] = None
    dtype: ApproxDtype = "auto"

    # a field validator (steps is validated first), so errors point at the field
    _coefficients_fit_steps = field_validator("coefficients")(_fit_steps)


class PolarExpress(SpecModel):
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


class GramNewtonSchulz(SpecModel):
    """Newton–Schulz's quintic run on the small Gram side (restarted Gram Newton–Schulz, Dao AI Lab
    2026, as in microsoft/dion): for X (m×n, m ≤ n) a step is X ← Q·X, Q = aI + bA + cA², A = XXᵀ,
    so only the m×m matrices R (X = R·X₀) and A ← QAQ are iterated; X = R·X₀ is formed at the end
    and after each step listed in ``restarts`` (where A is recomputed from it and R reset), for
    stability. The same map as newton_schulz (same ``steps`` and ``coefficients``) in fewer FLOPs
    where m ≪ n. ``restarts``: step numbers 1 … steps−1; the default [2] restarts after step 2
    where there is a step 3 (nothing where steps ≤ 2)."""

    kind: Literal["gram_newton_schulz"] = "gram_newton_schulz"
    steps: Annotated[int, Field(ge=1, le=100)] = 5
    coefficients: Optional[Union[NewtonSchulzSet, list[Triple]]] = None
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


class FrobeniusPrenorm(SpecModel):
    """D ← D/(‖D‖_F + ε) (Muon reference code, Scion)."""

    kind: Literal["frobenius"] = "frobenius"
    eps: PositiveFloat = 1e-7


class MaxPrenorm(SpecModel):
    """D ← D/max(‖D‖_F, ε) (torch.optim.Muon)."""

    kind: Literal["max"] = "max"
    eps: PositiveFloat = 1e-7


class AolPrenorm(SpecModel):
    """AOL rescaling (almost-orthogonal layers, Prach & Lampert 2022, arXiv:2208.03160; Turbo-Muon,
    Boissin et al. 2025, arXiv:2512.04632): D ← S·D, S = diag(max(Σⱼ |A_ij|, ε))^(−1/2), A = DDᵀ the
    Gram matrix of the smaller side (tall D: D·S with A = DᵀD). σ_max(S·D) ≤ 1 for every D, and
    the spectrum starts closer to 1 than D/‖D‖_F's, so Newton–Schulz needs about one step fewer;
    the iterations reuse A for their first step. Only with a polynomial approx (an exact one would
    factor S·D, whose polar factor is not D's)."""

    kind: Literal["aol"] = "aol"
    eps: PositiveFloat = 1e-7


class NoPrenorm(SpecModel):
    """No pre-normalization (the default for svd and gram_eigh)."""

    kind: Literal["none"] = "none"


Prenormalize = Annotated[Union[FrobeniusPrenorm, MaxPrenorm, AolPrenorm, NoPrenorm], Field(discriminator="kind")]

# ---------------------------------------------------------------- geometries

Scale = Literal["none", "scion", "muon_original", "match_rms_adamw"]
Layout = Literal["auto", "out_in", "in_out"]  # auto: in_out for Hugging Face Conv1D, else out_in


class AutoView(SpecModel):
    """The matrices the tensor's structure says it holds (:mod:`geomopt.compile.roles`): each
    expert of a batched (E, out, in) expert weight, each block of a fused projection (q, k, v;
    gate, up), a conv kernel as out × in·kh·kw; a plain (out, in) matrix otherwise."""

    kind: Literal["auto"] = "auto"


class MatrixView(SpecModel):
    """How a tensor is read as a batch of matrices. ``batch``: leading axes that index separate
    matrices (MoE experts: 1). The next axis is the rows; the axes after it are the columns
    (``trailing: cols``, conv: out × in·kh·kw), or the first of them is and the rest index
    separate matrices (``trailing: batch``, conv: one out × in matrix per kernel position).
    ``blocks``: the rows cut into k equal blocks, or into blocks of the given sizes, each its own
    matrix (heads, fused q,k,v under grouped-query attention, fused [gate, up])."""

    kind: Literal["matrix"] = "matrix"
    batch: Annotated[int, Field(ge=0)] = 0
    trailing: Literal["cols", "batch"] = "cols"
    blocks: Optional[Union[Annotated[int, Field(ge=1)],
                           Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]]] = None


View = Annotated[Union[AutoView, MatrixView], Field(discriminator="kind")]
VIEW_KINDS = kinds_of(View)


class _Geometry(SpecModel):
    radius: PositiveFloat = 1.0


class _MatrixGeometry(_Geometry):
    view: Optional[View] = None

    @field_validator("view", mode="before")
    @classmethod
    def view_shorthand(cls, v):
        return view_shorthand(v)


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

    @field_validator("prenormalize")
    @classmethod
    def _iterations_need_prenormalize(cls, v, info):
        """A polynomial iteration maps [0, 1] to about 1 and diverges (to ±∞, then NaN) for singular
        values past its basin (≈ 1.5 for Muon's coefficients): without pre-normalization a finite
        gradient of norm above that makes the parameters NaN, so it is refused. AOL with an exact
        approx is refused too (:class:`AolPrenorm`)."""
        approx = info.data.get("approx")
        if isinstance(v, NoPrenorm) and isinstance(approx, (NewtonSchulz, GramNewtonSchulz, PolarExpress)):
            raise ValueError(f"prenormalize: none with approx {approx.kind}: its polynomial iteration diverges "
                             f"(to NaN) for singular values above about 1.5, and a gradient's are unbounded; use "
                             f"prenormalize: frobenius (the default), max or aol, or an exact approx (svd, gram_eigh)")
        if isinstance(v, AolPrenorm) and isinstance(approx, (Svd, GramEigh)):
            raise ValueError(f"prenormalize: aol with approx {approx.kind}: AOL rescales D's rows (or columns), so an "
                             f"exact approx would factor the rescaled matrix, not D; use it with a polynomial "
                             f"approx (newton_schulz, gram_newton_schulz, polar_express), or prenormalize: frobenius "
                             f"or max")
        return v


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


#: the kronecker fields only some methods read, and which (every method reads the others)
KRONECKER_METHOD_FIELDS = {"beta": ("shampoo", "soap"), "damping": ("shampoo",), "exponent": ("shampoo",),
                           "root": ("shampoo",), "graft": ("shampoo",), "betas": ("shampoo", "soap"),
                           "eps": ("shampoo", "soap"), "momentum": ("psgd",), "precond_lr": ("psgd",)}


class Kronecker(_MatrixGeometry):
    """A metric learned from the gradients, per (shape[0], rest) matrix D (a ``view``: per expert,
    per equal block of the rows, each matrix with its own factors). ``method`` ``shampoo``
    and ``soap`` keep Kronecker factors L ← βL + w·D·Dᵀ and R ← βR + w·Dᵀ·D (w = 1 − β; β = 1: the
    plain sum, w = 1); ``shampoo`` steps along L^(−1/p)·D·R^(−1/p) from roots (L + εI)^(−1/p)
    recomputed every ``every`` steps (``root``: eigh or the coupled Newton iteration; p =
    ``exponent``, default 2 × the sides kept), its length optionally grafted onto another map's
    (``graft``); ``soap`` runs Adam (``betas``, ``eps``) in the factors' eigenbases, refreshed every
    ``every`` steps. A side longer than ``max_dim`` keeps no factor (the identity there). ``psgd``
    (PSGD-Kron) keeps its own momentum m ← μm + (1 − μ)D (μ = ``momentum``, debiased) and steps along
    Q_LᵀQ_L·m̂·Q_RᵀQ_R, the RMS capped at 1.1, with triangular factors fitted to PSGD's criterion every
    ``every`` steps (step size ``precond_lr``); a side longer than ``max_dim`` keeps a diagonal factor.
    Outside the paper's fixed-φ theory: its φ changes with the data."""

    kind: Literal["kronecker"] = "kronecker"
    method: Literal["shampoo", "soap", "psgd"] = "shampoo"
    beta: Annotated[float, Field(gt=0, le=1)] = 0.95
    damping: Annotated[float, Field(ge=0)] = 1e-12
    exponent: Optional[Annotated[int, Field(ge=1, le=32)]] = None
    every: Annotated[int, Field(ge=1)] = 10
    root: Literal["eigh", "newton"] = "eigh"
    graft: Literal["none", "adagrad", "adam", "spectral"] = "none"
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.95, 0.95]
    eps: PositiveFloat = 1e-8
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    precond_lr: Annotated[float, Field(gt=0, le=1)] = 0.1
    max_dim: Optional[Annotated[int, Field(ge=1)]] = None
    layout: Layout = "auto"

    @model_validator(mode="after")
    def _method_fields(self):
        """Fields of other methods given a value other than their default are refused (they would do
        nothing; a dump of the model, defaults and all, validates again)."""
        fields = type(self).model_fields
        stray = [f for f, methods in KRONECKER_METHOD_FIELDS.items()
                 if self.method not in methods and getattr(self, f) != fields[f].default]
        if stray:
            owners = sorted({m for f in stray for m in KRONECKER_METHOD_FIELDS[f]})
            raise ValueError(f"{', '.join(stray)} belong{'s' if len(stray) == 1 else ''} to method "
                             f"{' or '.join(owners)}, not {self.method}: remove {'it' if len(stray) == 1 else 'them'}"
                             f" or set method: {owners[0]}")
        return self


def kronecker_side(method: str, k: int, max_dim: Optional[int]) -> str:
    """The factor a kronecker ``method`` keeps on a side of ``k``: ``full`` (k × k: Shampoo's and SOAP's
    statistics) or ``none`` (the identity there) past ``max_dim``; PSGD's ``triangular`` (k × k) or,
    for k = 1 or past ``max_dim``, ``diagonal`` (k: Kron's ``max_size_triangular``)."""
    over = max_dim is not None and k > max_dim
    if method == "psgd":
        return "diagonal" if over or k == 1 else "triangular"
    return "none" if over else "full"


Geometry = Annotated[
    Union[Euclidean, Isotropic, Anisotropic, Spectral, Rowwise, Columnwise, Adam, Kronecker],
    Field(discriminator="kind"),
]
GEOMETRY_KINDS = kinds_of(Geometry)
