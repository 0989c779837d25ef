"""A plan's typed fragments: what one tensor's operators are, resolved and frozen.

A plan holds the spec's own models (:mod:`geomopt.spec`: frozen, typed, validated) with their
per-tensor values resolved by :mod:`geomopt.compile.resolve` (the layout the operators see,
Newton–Schulz's pre-normalization, a ``relative`` radius made absolute: each a ``model_copy`` with
a value of the field's own type). Two things a spec cannot say have their own frozen types: the
concrete matrix view of one tensor (:class:`View`) and the geometry that carries it
(:class:`ResolvedGeometry`). Everything on the step path (the engine and the arithmetic units of
:mod:`geomopt.geometry`) reads them by attribute, typed; the functional API validates its plain
dicts into these types once, at its entry. Reading by field name (``fragment["kind"]``) is left to
build-time code that handles raw spec data. :func:`plain` gives any fragment's JSON-able form (the
bucket digests, ``geomopt plan --format json``, the printed step programs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Optional

from pydantic import BaseModel

from geomopt.spec.geometries import Approx, Geometry, Layout, Prenormalize, Reference

_VIEW_FIELDS = ("batch", "trailing", "blocks", "factors", "layout", "scale_constraint")


@dataclasses.dataclass(frozen=True)
class View:
    """How one tensor is read as a batch of matrices (:mod:`geomopt.geometry.view` says what each
    field means): ``batch`` leading axes of matrices, ``trailing`` "cols" or "batch", the rows cut
    into ``blocks``, each block's radius ``factors`` over block 0's, ``layout`` "in_out" where each
    matrix is stored transposed (only the scale presets read it), and ``scale_constraint``: a
    ``relative`` constraint's radius scales by the factors too."""

    batch: int
    trailing: str
    blocks: Optional[tuple[int, ...]]
    factors: Optional[tuple[float, ...]] = None
    layout: Optional[str] = None
    scale_constraint: bool = False

    def __getitem__(self, key: str) -> Any:
        if key not in _VIEW_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _VIEW_FIELDS else default

    def __contains__(self, key: object) -> bool:
        return key in _VIEW_FIELDS

    def keys(self) -> tuple[str, ...]:
        return _VIEW_FIELDS

    def plain(self) -> dict:
        """The JSON-able form: ``layout`` and ``scale_constraint`` only where they say something."""
        out: dict = {"batch": self.batch, "trailing": self.trailing,
                     "blocks": None if self.blocks is None else list(self.blocks),
                     "factors": None if self.factors is None else list(self.factors)}
        if self.layout is not None:
            out["layout"] = self.layout
        if self.scale_constraint:
            out["scale_constraint"] = True
        return out


@dataclasses.dataclass(frozen=True)
class ResolvedGeometry:
    """A tensor's geometry: the spec geometry (``layout`` and ``prenormalize`` resolved) and, for
    the geometries that read matrices, the tensor's concrete :class:`View` (None: the plain
    matrix). The fields some kinds have are typed properties (None where the kind has none). Read by
    name (build-time code only) it answers as the spec geometry whose ``view`` is the concrete one."""

    spec: Geometry
    view: Optional[View] = None

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def radius(self) -> float:
        return self.spec.radius

    # The fields some kinds have, typed, None where the kind has none (a plain lookup:
    # ``getattr`` on a field a model lacks goes through pydantic's slow ``__getattr__``).

    @property
    def approx(self) -> Optional[Approx]:
        """The spectral geometry's approximation (None for the others)."""
        return self.spec.__dict__.get("approx")

    @property
    def approx_kind(self) -> Optional[str]:
        approx = self.approx
        return None if approx is None else approx.kind

    @property
    def reference(self) -> Optional[Reference]:
        """The reference function h (None for euclidean, adam and kronecker)."""
        return self.spec.__dict__.get("reference")

    @property
    def prenormalize(self) -> Optional[Prenormalize]:
        """The spectral geometry's pre-normalization (None: the approximation's default)."""
        return self.spec.__dict__.get("prenormalize")

    @property
    def layout(self) -> Layout:
        """The layout the operators read (``out_in`` for the kinds without the field)."""
        return self.spec.__dict__.get("layout", "out_in")

    def __post_init__(self) -> None:
        # made once (the instance is frozen), not on each step; not a field: equality, hashing and
        # the printed form are the spec's and the view's
        object.__setattr__(self, "_matrix", self if self.view is None else ResolvedGeometry(self.spec))

    @property
    def matrix(self) -> "ResolvedGeometry":
        """This geometry without its view: what an operator receives for one stack of the view's
        matrices."""
        return self._matrix  # type: ignore[attr-defined]

    def __getitem__(self, key: str) -> Any:
        if key == "view" and "view" in self.spec.__dict__:
            return self.view
        return self.spec[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key == "view":
            return self.view if "view" in self.spec.__dict__ else default
        return self.spec.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.spec.__dict__

    def keys(self):
        return self.spec.__dict__.keys()

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, self[k]) for k in self.spec.__dict__)

    def plain(self) -> dict:
        out = self.spec.model_dump()
        if "view" in out:
            out["view"] = None if self.view is None else self.view.plain()
        return out


def plain(fragment: Any) -> Any:
    """A fragment (typed or not) as plain JSON-able data: dicts, lists, numbers, strings."""
    if isinstance(fragment, (ResolvedGeometry, View)):
        return fragment.plain()
    if isinstance(fragment, BaseModel):
        return fragment.model_dump()
    if isinstance(fragment, Mapping):
        return {k: plain(v) for k, v in fragment.items()}
    if isinstance(fragment, (list, tuple)):
        return [plain(v) for v in fragment]
    return fragment
