"""The spec language as pydantic v2 models (strict, ``extra="forbid"``).

Every kind is a discriminated union on ``kind``; field names here are the contract that YAML, the
DSL, the JSON Schema and the operators in :mod:`geomopt.geometry` (which receive
``model_dump()`` dicts of these models) all share.

This module defines matching, the hyper-parameters, rules and the spec (and the helpers that
resolve a rule's effective settings). The kinds live by concept in :mod:`geomopt.spec.geometries`
(reference functions, spectral approximations, pre-normalization, views, geometries),
:mod:`geomopt.spec.constraints` and :mod:`geomopt.spec.updates` (directions, schedules,
post-stages, weight decay), on the common ground of :mod:`geomopt.spec.base`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union, get_args

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from geomopt.spec.base import SpecModel, view_shorthand, kinds_of_literal
from geomopt.spec.constraints import Constraint
from geomopt.spec.geometries import POLYNOMIAL_APPROX_KINDS, FrobeniusPrenorm, Geometry, NoPrenorm, Spectral
from geomopt.spec.patterns import pattern_error
from geomopt.spec.updates import (
    STAGE_ORDER,
    ConstantSchedule,
    Decay,
    DecoupledDecay,
    Direction,
    NoDirection,
    MaxLogitClip,
    PostStage,
    Schedule,
)

__all__ = ["Defaults", "Hyper", "Match", "RESOLVED_DEFAULTS", "ROLE_NAMES", "RoleName", "Rule", "ShapeDim", "Spec",
           "effective_prenormalize", "resolve_hyper"]


# ---------------------------------------------------------------- matching, rules, spec

ShapeDim = Union[Annotated[int, Field(ge=0)], Literal["*"]]

#: What a tensor does in its model (:mod:`geomopt.compile.roles` infers it).
RoleName = Literal["embedding", "head", "router", "expert", "norm", "bias", "hidden", "other"]
ROLE_NAMES = kinds_of_literal(RoleName)


def _check_regex(pattern: str) -> None:
    """A glob or ``re:`` pattern the matcher runs (:mod:`geomopt.spec.patterns`), else ValueError."""
    error = pattern_error(pattern)
    if error is not None:
        raise ValueError(error)


class Match(SpecModel):
    """Which parameters a rule owns: every given predicate must hold.

    ``name``: glob on the dotted name (``*`` within a segment, ``**`` across) or ``re:`` full-match
    regex; ``module``: the owning module's class name (or a base class's); ``role``: what the tensor
    does in the model (one role or a list, :data:`ROLE_NAMES`); ``ndim`` (an int or a list of
    allowed ints); ``shape`` (ints or ``"*"``).
    """

    name: Optional[str] = None
    module: Optional[str] = None
    role: Optional[Union[RoleName, Annotated[list[RoleName], Field(min_length=1)]]] = None
    ndim: Optional[Union[Annotated[int, Field(ge=0)],
                         Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]]] = None
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


#: the state precisions that keep moments as int8 codes with block scales (``int8-ec``: and a correction)
QUANTIZED = ("int8", "int8-ec")


class StatePrecision(SpecModel):
    """The precision the rule's optimizer state is kept in between steps (``state: bfloat16`` is
    short for ``state: {dtype: bfloat16}``): ``float32`` as torch keeps it; ``bfloat16`` written
    with stochastic rounding (torchao's low-bit optimizers, Zamirai et al. 2020: unbiased, so
    updates smaller than bf16's spacing are kept on average); ``int8`` for moments only, as
    block-wise dynamic quantization (Dettmers et al. 2022, arXiv:2110.02861: 256-entry blocks, each
    scaled by its largest magnitude, signed for first moments and unsigned for second);
    ``int8-ec``: int8 with error compensation, each code's rounding residual kept in 4 bits beside it
    and added back at the next decode (stochastically rounded, so unbiased), 0.38 of float32's bytes.

    ``compensation``: what the optimizer keeps of a bfloat16 parameter's rounding error, so that its
    updates are not lost to bf16's 8-bit significand (a step smaller than half the weight's spacing
    would otherwise round away): ``int8``, the error in 256ths of the weight's spacing (1 byte per
    weight; the weight read as bf16 + error carries about 16 significant bits); ``int16``, the rest
    of the float32 weight's bit pattern beside its nearest bf16 (the float32 weight exactly, as a
    split float32 master copy). The step runs on the float32 weight it decodes, and stores it back
    as bf16 + error. Float32 parameters of the rule keep no error (they lose nothing).

    ``factors``: the precision of a learned metric's factor statistics (the kronecker geometry's
    L and R: Shampoo's and SOAP's Σ GGᵀ, PSGD's Q), kept apart from the moments' ``dtype``
    because rounding lands on a factor's smallest eigenvalues, which its inverse root raises
    (Distributed Shampoo's ``factor_matrix_dtype``): ``float32``, or ``bfloat16`` written with
    stochastic rounding (half the bytes of the largest part of a Shampoo or SOAP state; the roots
    and eigenbases stay float32). A rule whose geometry keeps no factors has nothing to encode."""

    dtype: Literal["float32", "bfloat16", "int8", "int8-ec"] = "float32"
    compensation: Literal["none", "int8", "int16"] = "none"
    factors: Literal["float32", "bfloat16"] = "float32"


class Hyper(SpecModel):
    """Hyper-parameters shared by ``defaults`` and each rule (a rule's value overrides the default)."""

    lr: Optional[Annotated[float, Field(ge=0)]] = None
    weight_decay: Optional[Annotated[float, Field(ge=0)]] = None
    direction: Optional[Direction] = None
    decay: Optional[Decay] = None
    schedule: Optional[Schedule] = None
    on_nonfinite: Optional[Literal["skip", "raise", "off"]] = None
    project_on_init: Optional[bool] = None
    state: Optional[StatePrecision] = None

    @field_validator("decay", mode="before")
    @classmethod
    def _decay_shorthand(cls, v):
        return view_shorthand(v)

    @field_validator("state", mode="before")
    @classmethod
    def _state_shorthand(cls, v):
        return {"dtype": v} if isinstance(v, str) else v


class Defaults(Hyper):
    """Spec-wide defaults; unset fields fall back to lr 0.02, weight_decay 0, direction none,
    decay decoupled, schedule constant, on_nonfinite skip, project_on_init true, state float32."""


class Rule(Hyper):
    """``post``: stages applied to the geometry's update, in :data:`STAGE_ORDER`; one step is
    direction → geometry → post-stages → weight decay → constraint. ``qk_clip``: after the step,
    rescale the rule's query/key projections per attention head (:class:`MaxLogitClip`)."""

    name: Annotated[str, Field(pattern=_RULE_NAME)]
    match: Match
    geometry: Geometry
    post: Optional[Annotated[list[PostStage], Field(min_length=1)]] = None
    constraint: Optional[Constraint] = None
    qk_clip: Optional[MaxLogitClip] = None

    @field_validator("match", mode="before")
    @classmethod
    def _match_shorthand(cls, v):
        return {"name": v} if isinstance(v, str) else v

    @field_validator("post", mode="before")
    @classmethod
    def _post_shorthand(cls, v):
        return [view_shorthand(s) for s in v] if isinstance(v, list) else v

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

    @field_validator("constraint")
    @classmethod
    def _msign_needs_a_spectral_approx(cls, v, info):
        geometry = info.data.get("geometry")
        if getattr(v, "method", None) == "msign" and geometry is not None and geometry.kind != "spectral":
            raise PydanticCustomError(
                "msign_geometry", "stiefel method 'msign' retracts by the rule's spectral approximation; "
                "the {geometry} geometry has none (use a spectral geometry, or method exact or polar)",
                {"geometry": geometry.kind})
        return v


class Spec(SpecModel):
    """A whole spec: ordered rules, the first match owns a parameter. ``roles`` gives tensors a
    role by name pattern (glob or ``re:``), over what is inferred from the model."""

    geomopt: Literal[1]
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    defaults: Defaults = Field(default_factory=Defaults)
    roles: dict[RoleName, Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = Field(
        default_factory=dict)
    rules: Annotated[list[Rule], Field(min_length=1)]
    #: the spec this one was merged onto (geomopt.spec.extends: a shipped name or a path), as
    #: written; the other fields hold the merged result. Not in model_dump() (nor equality).
    extends: Optional[str] = Field(default=None, exclude=True, description=(
        "A spec to build on: a shipped spec's name (muon, scion, …) or a path (relative to this file). "
        "This spec's defaults and roles merge onto the base's, its rules override the base's rules of the "
        "same name or are added (before/after a base rule, or at the end); `remove: true` drops one."))
    _source: Any = PrivateAttr(default=None)  # positions, when parsed from text

    @property
    def source(self) -> Any:
        """The :class:`~geomopt.spec.source.SourceMap` the spec was parsed with (None for a spec
        built in Python)."""
        return self._source

    def with_source(self, source) -> "Spec":
        """This spec, noting the positions it was parsed with; returns it."""
        self._source = source
        return self

    def __eq__(self, other) -> bool:  # equal content, wherever it was parsed from
        return isinstance(other, Spec) and self.model_dump() == other.model_dump()

    # unhashable, as equality is by content; mypy wants object's method signature, Python takes None to mean unhashable
    __hash__ = None  # type: ignore[assignment]

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
    lr=0.02, weight_decay=0.0, direction=NoDirection(), decay=DecoupledDecay(), schedule=ConstantSchedule(),
    on_nonfinite="skip", project_on_init=True, state=StatePrecision(),
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
    defaults on (ε = 1e-7) for them (:data:`POLYNOMIAL_APPROX_KINDS`), and ``none`` is refused
    with them; off for svd and gram_eigh (geomopt.geometry.spectral: pre-normalization). ``aol``
    (Turbo-Muon's rescaling, for the polynomial iterations only) replaces D/‖D‖_F by S·D with the
    same σ_max ≤ 1 and a spectrum nearer 1, so Newton–Schulz needs about one step fewer: catalogue
    entry ``turbo-muon`` runs 4 steps of the ``aol`` coefficient set from it."""
    if geometry.prenormalize is not None:
        return geometry.prenormalize
    if geometry.approx.kind in POLYNOMIAL_APPROX_KINDS:
        return FrobeniusPrenorm()
    return NoPrenorm()


def direction_models() -> tuple[type[SpecModel], ...]:
    """The spec models of the language's direction kinds, in order."""
    annotation = Hyper.model_fields["direction"].annotation  # Optional[Annotated[Union[…], …]]
    union = next(a for a in get_args(annotation) if a is not type(None))
    return get_args(get_args(union)[0])


def extend_directions(*, add: Optional[type[SpecModel]] = None, remove: Optional[str] = None) -> None:
    """Add a direction kind to the language (``add``: its spec model, a :class:`SpecModel` whose
    ``kind`` is a ``Literal``), or take one added so out (``remove``: its kind): every model that
    holds a ``direction`` (defaults, rules, the spec) is rebuilt with the new union, so YAML, the
    DSL, validation, the printers and the JSON Schema know it. Its arithmetic and state are its
    unit's, declared beside it (:func:`geomopt.optim.units.directions.direction`)."""
    members = [m for m in direction_models() if m.model_fields["kind"].default != remove]
    if add is not None:
        kind = add.model_fields["kind"].default
        if any(m.model_fields["kind"].default == kind for m in members):
            raise ValueError(f"direction kind {kind!r} is in the language already")
        members.append(add)
    union: Any = Annotated[Union[tuple(members)], Field(discriminator="kind")]  # type: ignore[valid-type]
    field: Any = Optional[union]
    for cls in (Hyper, Defaults, Rule):
        cls.__pydantic_fields__["direction"] = FieldInfo.from_annotated_attribute(field, None)
        cls.model_rebuild(force=True)
    Spec.model_rebuild(force=True)
