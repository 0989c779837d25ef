"""Declared units: what each piece of a step says about itself, once, where it is written.

A unit (a direction, a post-stage, the adam geometry's moments, the gap monitor) declares the
state it keeps as :class:`StateKey` entries, under the *kind* of state they make together (moved
across a spec change together or not at all); a direction also declares its spec model, the
group values it reads, the execution forms it has beyond the generic stacked one and the forms it
refuses, with why (:class:`DirectionUnit`). Every table that lists state keys, group keys or
direction coefficients (the precision codec's moments, the stacked keys, the load checks, the
migration kinds, the checkpoint's spec values) is derived from these declarations
(:mod:`geomopt.optim.units.state_keys`), never listed by hand, so a new unit is one declaration.

Torch-free: the declarations are data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from geomopt.registry import LOCAL, Registry

#: a state entry's layout: ``op``, the operators' layout of the tensor (the momentum's; transposed
#: for ``layout: in_out``); ``param``, the parameter's own (an iterate); ``stat``, a statistic whose
#: dims are each whole or summed out; ``own``, a shape of the unit's own (checked by it); ``count``,
#: a step count (an int64 tensor); ``weight``, what a low-precision parameter's stored form lost (the
#: parameter's own shape; an integer tensor kept beside it, read and written around the step, never
#: stacked)
OP, PARAM, STAT, OWN, COUNT, WEIGHT = "op", "param", "stat", "own", "count", "weight"
LAYOUTS = (OP, PARAM, STAT, OWN, COUNT, WEIGHT)
#: a moment's sign: ``first`` (signed: an average of gradients) or ``second`` (a mean of squares,
#: never negative); moments are what a rule's ``state`` precision (bfloat16, int8, int8-ec) encodes
FIRST, SECOND = "first", "second"

#: the execution forms a direction may have (:mod:`geomopt.optim.engine.program`): ``stacked`` (on a
#: bucket's stacked gradients; every direction), ``flat`` (foreach over an elementwise rule's flat
#: buffers), ``rows`` (read row by row from the unstacked gradients, or ahead of a deferred
#: finiteness test), ``weighted`` (its list form reads one coefficient, ``alpha``, which may be a 0-d
#: tensor, and leaves d as it is at α = 0: a capturable step weights it by the device's finiteness
#: flag, a compiled step takes it as an input, so a schedule of it compiles nothing again), and the
#: settings it must run under: ``capturable`` (no host decision) and ``sharded`` (on each rank's shard
#: of a DTensor)
FORMS = ("stacked", "flat", "rows", "weighted", "capturable", "sharded")


@dataclasses.dataclass(frozen=True)
class StateKey:
    """One entry of a tensor's optimizer state: its key, its layout (:data:`LAYOUTS`) and, for a
    moment, its sign (:data:`FIRST` or :data:`SECOND`; None: kept in float32 whatever the rule's
    state precision); ``factor``: a learned metric's factor, kept in the rule's factor precision."""

    key: str
    layout: str = OP
    moment: Optional[str] = None
    #: a learned metric's factor statistic, kept in the rule's ``state: {factors: …}`` precision
    factor: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"state {self.key!r}: layout {self.layout!r} is not one of {LAYOUTS}")
        if self.moment not in (None, FIRST, SECOND):
            raise ValueError(f"state {self.key!r}: moment {self.moment!r} is not first, second or None")
        if self.factor and (self.moment is not None or self.layout != OWN):
            raise ValueError(f"state {self.key!r}: a factor is a matrix of the unit's own layout, not a moment")


#: every state key a unit keeps, by key (two units may keep one key if they declare it alike)
STATE = Registry("state key")
#: kinds of state (``momentum``, ``adam``, a stage's name, …) → the keys they are made of
STATE_KINDS = Registry("state kind")


def declare(kind: Optional[str], *keys: StateKey) -> tuple[StateKey, ...]:
    """Declare ``keys`` as state a unit keeps; under ``kind`` (a migration moves them together)
    unless None (never carried across a spec change). A key declared twice must be declared alike."""
    for k in keys:
        if k.key in STATE and STATE[k.key] != k:
            raise ValueError(f"state {k.key!r} is declared twice, differently: {STATE[k.key]} and {k}")
        STATE.setdefault(k.key, k)
    if kind is not None:
        names = tuple(k.key for k in keys)
        if kind in STATE_KINDS and STATE_KINDS[kind] != names:
            raise ValueError(f"state kind {kind!r} is declared twice, differently: {STATE_KINDS[kind]} and {names}")
        STATE_KINDS.setdefault(kind, names)
    return keys


@dataclasses.dataclass(frozen=True)
class DirectionUnit:
    """A direction estimator d (:mod:`geomopt.optim.units.directions`): ``fn(g, state, group, *, g_prev,
    inplace, fresh) -> d`` on a stacked (or single) gradient; ``spec``, its spec model (its fields
    but ``kind`` are the group values it reads, :attr:`coefficients`); ``state``, the entries it
    keeps, under the state kind ``migrates`` (None: not carried across a spec change);
    ``forms``, the execution forms it has besides ``stacked``; ``refuses``, form → why it cannot run
    so (a construction error says it); ``locality``, where it can run on a shard."""

    name: str
    fn: Callable
    spec: Any
    state: tuple[StateKey, ...] = ()
    migrates: Optional[str] = None
    forms: tuple[str, ...] = ()
    refuses: tuple[tuple[str, str], ...] = ()
    locality: str = LOCAL

    def __post_init__(self):
        bad = [f for f in (*self.forms, *dict(self.refuses)) if f not in FORMS]
        if bad:
            raise ValueError(f"direction {self.name!r}: unknown form(s) {bad}; known: {FORMS}")

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of the state entries it keeps (empty: it keeps none and passes g on as d)."""
        return tuple(k.key for k in self.state)

    @property
    def coefficients(self) -> tuple[str, ...]:
        """The group values the direction reads: its spec model's fields but ``kind``."""
        return tuple(f for f in self.spec.model_fields if f != "kind")

    @property
    def keeps_prev(self) -> bool:
        """It keeps the previous iterate (a second evaluation of the closure at it)."""
        return any(k.layout == PARAM for k in self.state)

    def has(self, form: str) -> bool:
        """Whether the direction runs in ``form`` (:data:`FORMS`)."""
        return form not in dict(self.refuses) and (form in self.forms or form in ("stacked", "capturable", "sharded"))

    def why_not(self, form: str) -> Optional[str]:
        """Why the direction cannot run in ``form``, or None."""
        return dict(self.refuses).get(form)
