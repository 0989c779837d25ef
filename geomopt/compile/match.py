"""Which parameters a rule owns: whole-name globs and regexes, module class, ndim, shape.

Names match whole (``layers.1`` never matches ``layers.10``; ``head`` never ``decode_head``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from geomopt.spec.model import Match
from geomopt.spec.patterns import NamePattern, compile_pattern

if TYPE_CHECKING:
    from geomopt.compile.roles.types import Role


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """What the compiler knows of a tensor: names, shape, dtype, owning module classes.

    ``modules`` holds the owning module's class name and its base classes' (so ``module: Linear``
    also owns ``NonDynamicallyQuantizableLinear``); None when unknown (a checkpoint).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    requires_grad: bool = True
    modules: Optional[tuple[str, ...]] = None
    aliases: tuple[str, ...] = ()  # other names of the same (tied) tensor
    device: str = "cpu"
    role: Optional[Role] = None  # once assigned

    @property
    def ndim(self) -> int:
        return len(self.shape)


def glob_regex(pattern: str) -> NamePattern:
    """Glob on dotted names: ``*`` within a segment, ``**`` across segments, ``?`` one character;
    ``re:…`` is a full-match regular expression (Python's syntax and meaning). The result's ``fullmatch(name)`` runs
    in time linear in the name (:mod:`geomopt.spec.patterns`); raises ValueError for a refused pattern."""
    return compile_pattern(pattern)


def any_name(fullmatch, p: ParamInfo) -> bool:
    """Whether ``fullmatch`` (a compiled name pattern's) matches any name of ``p``: a tied tensor
    matches a name pattern if any of its names does."""
    return fullmatch(p.name) is not None or (bool(p.aliases) and any(fullmatch(a) for a in p.aliases))


class Matcher:
    """A :class:`Match` compiled once: its predicates as plain values (the regex compiled, ``ndim``
    as a set), so matching a rule against thousands of tensors costs one regex call per name."""

    __slots__ = ("fullmatch", "ndims", "shape", "module", "roles")

    def __init__(self, match: Match):
        self.fullmatch = glob_regex(match.name).fullmatch if match.name is not None else None
        ndim = match.ndim
        self.ndims = None if ndim is None else frozenset(ndim if isinstance(ndim, list) else [ndim])
        self.shape = None if match.shape is None else tuple(match.shape)
        self.module = match.module
        role = match.role
        self.roles = None if role is None else frozenset(role if isinstance(role, list) else [role])

    def _role_ok(self, p: ParamInfo) -> bool:
        assert self.roles is not None  # callers test it first
        return p.role is not None and not self.roles.isdisjoint(p.role.roles)

    def _shape_ok(self, shape: tuple[int, ...]) -> bool:
        assert self.shape is not None  # callers test it first
        return len(self.shape) == len(shape) and all(s == "*" or s == d for s, d in zip(self.shape, shape))

    def __call__(self, p: ParamInfo) -> Optional[bool]:
        """True / False, or None when a module predicate cannot be decided (no module information).

        A tied tensor matches a name pattern if any of its names does."""
        fm = self.fullmatch
        if fm is not None and not any_name(fm, p):
            return False
        if self.ndims is not None and len(p.shape) not in self.ndims:
            return False
        if self.shape is not None and not self._shape_ok(p.shape):
            return False
        if self.roles is not None and not self._role_ok(p):
            return False
        if self.module is not None:
            if p.modules is None:
                return None
            return self.module in p.modules
        return True

    def select(self, params: list[ParamInfo]) -> tuple[list[int], list[int]]:
        """(indices of ``params`` it matches, indices it cannot decide): ``self(p)`` for every p,
        one predicate at a time over the survivors of the previous one."""
        idx: list[int] = list(range(len(params)))
        if self.ndims is not None:
            ndims = self.ndims
            idx = [i for i in idx if len(params[i].shape) in ndims]
        fm = self.fullmatch
        if fm is not None:
            idx = [i for i in idx if any_name(fm, params[i])]
        if self.shape is not None:
            idx = [i for i in idx if self._shape_ok(params[i].shape)]
        if self.roles is not None:
            idx = [i for i in idx if self._role_ok(params[i])]
        if self.module is None:
            return idx, []
        module = self.module
        undecided = [i for i in idx if params[i].modules is None]
        return [i for i in idx if (mods := params[i].modules) is not None and module in mods], undecided


def matches(match: Match, p: ParamInfo) -> Optional[bool]:
    """True / False, or None when a module predicate cannot be decided (no module information).

    A tied tensor matches a name pattern if any of its names does."""
    return Matcher(match)(p)


def describe(match: Match) -> str:
    parts = []
    if match.name is not None:
        parts.append(repr(match.name))
    if match.module is not None:
        parts.append(f"module={match.module}")
    if match.role is not None:
        parts.append(f"role={match.role if isinstance(match.role, str) else '|'.join(match.role)}")
    if match.ndim is not None:
        parts.append(f"ndim={match.ndim}")
    if match.shape is not None:
        parts.append(f"shape={list(match.shape)}")
    return " ".join(parts)


def shape_text(p: ParamInfo) -> str:
    """``4×3``, or ``scalar``."""
    return "×".join(map(str, p.shape)) or "scalar"
