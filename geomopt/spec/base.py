"""The spec language's common ground: the strict base model, shared field types, ``{kind: …}`` shorthand.

The kinds themselves are in :mod:`geomopt.spec.geometries`, :mod:`geomopt.spec.constraints` and
:mod:`geomopt.spec.updates`; rules and the spec in :mod:`geomopt.spec.model`.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field

PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(gt=0, le=1)]


class SpecModel(BaseModel):
    # allow_inf_nan=False: no field means anything at ±inf/nan, and the DSL has no spelling for them
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    # Read-only access by field name, as a mapping, for build-time code that handles a spec's data
    # generically (compile, lint, printing). The step path reads attributes (tests/test_typed_plan.py).
    def __getitem__(self, key: str) -> Any:
        try:
            return self.__dict__[key]
        except KeyError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__

    def keys(self):
        return self.__dict__.keys()

    def items(self):
        return self.__dict__.items()


# Fields whose value is a {kind: …} mapping: a bare word there (DSL) names the kind.
KIND_FIELDS = frozenset({"geometry", "constraint", "reference", "approx", "prenormalize", "direction", "schedule",
                         "view", "decay", "post", "qk_clip"})


def field(model, name: str, default=None):
    """A spec model's field, or ``default`` where its kind has none (a plain lookup: ``getattr``
    on a field a model lacks goes through pydantic's slow ``__getattr__``)."""
    return model.__dict__.get(name, default)


def kinds_of(union: Any) -> tuple[str, ...]:
    """The ``kind`` values of a discriminated union of models (``Annotated[Union[…], Field(…)]``),
    in the union's order: the one place each list of kinds is written."""
    members = get_args(get_args(union)[0])
    return tuple(m.model_fields["kind"].default for m in members)


def kinds_of_literal(literal: Any) -> tuple[str, ...]:
    """The values of a ``Literal[…]``, in order."""
    return tuple(get_args(literal))


def view_shorthand(v):
    """``view: auto`` is shorthand for ``view: {kind: auto}`` (likewise ``decay`` and each post-stage)."""
    return {"kind": v} if isinstance(v, str) else v
