"""One small helper for every registry of named units (geometries' forward and backward operators,
approximations, directions, schedules, post-stages, lint rules, references).

A :class:`Registry` is a ``dict`` (lookups, ``in``, iteration work as on any mapping) that units
join with a decorator, ``@REGISTRY.register(key, **meta)``; ``meta`` (a locality, a severity, …)
is kept beside the unit in :attr:`Registry.meta`. Registering a key twice is an error (two units
cannot own one name), and looking up an unknown key raises a ``KeyError`` that names what the
registry holds and the known keys. Torch-free: lint and the spec layer import it.

Also here, torch-free: the localities an operator declares when it registers (its ``locality``
meta), which say where it can run when a tensor is split across ranks
(:mod:`geomopt.distributed.executors`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")

#: Localities. ``LOCAL``: elementwise, runs on any shard as is. ``REDUCE``: needs whole-tensor,
#: row or column norms (torch reduces them over shards). ``OWNER``: a matrix function (SVD, polar,
#: Newton–Schulz, top-k) that needs the whole matrix on one rank.
LOCAL, REDUCE, OWNER = "local", "reduce", "owner"
LOCALITIES = (LOCAL, REDUCE, OWNER)


class Registry(dict):
    """Named units of one kind (``what``: "forward op", "lint rule", …)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.meta: dict[Hashable, dict[str, Any]] = {}

    def register(self, *keys: Hashable, **meta: Any) -> Callable[[T], T]:
        """Decorator: register the unit under each of ``keys`` (its ``__name__`` when none), with
        ``meta``."""

        def add(unit: T) -> T:
            # getattr: a unit is any object (T); mypy cannot know it has a __name__
            for key in keys or (getattr(unit, "__name__"),):  # noqa: B009
                self.add(key, unit, **meta)
            return unit

        return add

    def add(self, key: Hashable, unit: Any, **meta: Any) -> None:
        if key in self:
            raise ValueError(f"{self.what} {key!r} is registered twice ({self[key]!r} and {unit!r})")
        self[key] = unit
        self.meta[key] = meta

    def __missing__(self, key: Hashable):
        known = ", ".join(map(str, self)) or "none"
        raise KeyError(f"unknown {self.what} {key!r}; known: {known}")
