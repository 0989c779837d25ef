"""Every table of state keys, group keys and direction coefficients, derived from the units'
declarations (:mod:`geomopt.optim.units.declare`), never listed by hand.

The declarations are the directions' (:mod:`geomopt.optim.units.directions`), the post-stages'
(:mod:`geomopt.optim.units.stages`) and, here, the two pieces of state that belong to no registered
unit: the adam geometry's moments and step count (:func:`geomopt.geometry.adam.adam_moments`
keeps them) and the gap monitor's last subgradient (``track_gap``).
"""

from __future__ import annotations

from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units import stages  # noqa: F401  (the post-stages declare their state on import)
from geomopt.optim.units import compensation  # noqa: F401  (a low-precision weight's lost bits, likewise)
from geomopt.optim.units.declare import (COUNT, FIRST, OP, OWN, PARAM, SECOND, STAT, STATE, STATE_KINDS, WEIGHT,
                                          StateKey, declare)
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.geometry.operators import forward_locality
from geomopt.registry import OWNER, Registry
from geomopt.spec.geometries import Kronecker

#: the adam geometry's state (torch.optim.AdamW's exp_avg, exp_avg_sq and step)
ADAM_STATE = declare("adam", StateKey("exp_avg", moment=FIRST), StateKey("exp_avg_sq", moment=SECOND),
                     StateKey("adam_step", layout=COUNT))
#: ``track_gap``'s last subgradient w of the constraint (the Frank–Wolfe gap's)
GAP_STATE = declare("gap", StateKey("w"))

#: the kronecker geometry's state per matrix (:mod:`geomopt.geometry.learned`), one kind per method.
#: Shampoo: the factors, their roots, AdaGrad's or Adam's sum of squares for a graft (float32, laid
#: out as the operators see the tensor; empty without a graft), the step count.
#: The factors are kept in the rule's factor precision (``state: {factors: …}``, float32 unless
#: asked), never the moments' ``dtype``: a factor's entries are signed (not a second moment), and
#: its rounding lands on its smallest eigenvalues, which the inverse root raises to −1/p. The roots
#: stay float32 (recomputed every ``every`` steps, they are what multiplies each update). A side
#: longer than ``max_dim`` (and a graft of none) holds an empty entry: every key is in the state of
#: every tensor the geometry steps.
SHAMPOO_STATE = declare(
    "shampoo", StateKey("shampoo_left", layout=OWN, factor=True), StateKey("shampoo_right", layout=OWN, factor=True),
    StateKey("shampoo_left_root", layout=OWN), StateKey("shampoo_right_root", layout=OWN),
    StateKey("shampoo_graft", layout=OWN), StateKey("shampoo_step", layout=COUNT),
)
#: SOAP: Adam's first moment in the gradient's basis (as the reference keeps it) and its second in
#: the rotated basis, both moments the state precision may encode; the factors follow the factor
#: precision, as Shampoo's; the bases stay float32 (an encoded basis is no longer orthogonal, and the
#: rotation would stop being one).
SOAP_STATE = declare(
    "soap", StateKey("soap_left", layout=OWN, factor=True), StateKey("soap_right", layout=OWN, factor=True),
    StateKey("soap_left_basis", layout=OWN), StateKey("soap_right_basis", layout=OWN),
    StateKey("soap_exp_avg", layout=OP, moment=FIRST), StateKey("soap_exp_avg_sq", layout=OP, moment=SECOND),
    StateKey("soap_step", layout=COUNT),
)

#: PSGD-Kron: the factors Q_L, Q_R (triangular k × k, or a diagonal of k) follow the factor
#: precision (stochastic rounding keeps the fit's small steps on average; heavyball keeps them in
#: bf16 too); the momentum is a first moment the state precision may encode (laid out as the
#: operators see the tensor).
PSGD_STATE = declare(
    "psgd", StateKey("psgd_left", layout=OWN, factor=True), StateKey("psgd_right", layout=OWN, factor=True),
    StateKey("psgd_momentum", layout=OP, moment=FIRST), StateKey("psgd_step", layout=COUNT),
)


def geometry_kind(geometry: ResolvedGeometry) -> "str | None":
    """The kind of state a rule's forward op keeps (adam; a kronecker geometry's method), or None."""
    spec = geometry.spec
    kind = spec.method if isinstance(spec, Kronecker) else spec.kind  # a kronecker geometry: its method's state
    return kind if kind in STATE_KINDS else None


def geometry_state(geometry: ResolvedGeometry) -> tuple[str, ...]:
    """The state keys a rule's forward op keeps: its declared kind's (adam's moments, a kronecker
    method's factors); () for a geometry without state."""
    kind = geometry_kind(geometry)
    return () if kind is None else STATE_KINDS[kind]


def owner_state(geometry: ResolvedGeometry, sharded: bool) -> tuple[str, ...]:
    """The state keys a rule's forward op keeps whole, on each matrix's owning rank alone, where its
    tensors are ``sharded``: a stateful op whose registration runs it ``OWNER`` on shards (the
    kronecker geometry's factors, roots, bases, moments and step count); () elsewhere (replicated or
    one-process tensors keep their state in the bucket's stack, sharded ones like the parameter)."""
    if not sharded or forward_locality(geometry.kind, sharded=True) != OWNER:
        return ()
    return geometry_state(geometry)


#: the suffix of an int8 moment's block scales (``d`` → ``d_absmax``)
SCALE = "_absmax"
#: the suffix of an ``int8-ec`` moment's rounding correction (``d`` → ``d_ec``: 4 bits per entry, two
#: to a byte, placing each value within its code's bin; :mod:`geomopt.optim.persist.state_codec`)
CORRECTION = "_ec"
#: the suffixes of the entries kept beside an encoded moment's codes
SIDE = (SCALE, CORRECTION)


def moments(state: Registry = STATE) -> dict[str, bool]:
    """Moment key → signed (a first moment) or not (a second): what a rule's ``state`` precision
    encodes; every other key stays float32."""
    return {k: s.moment == FIRST for k, s in state.items() if s.moment is not None}


def factors(state: Registry = STATE) -> tuple[str, ...]:
    """The learned metrics' factor keys: what a rule's ``state: {factors: …}`` precision encodes."""
    return tuple(k for k, s in state.items() if s.factor)


def keys_in(layout: str, state: Registry = STATE) -> tuple[str, ...]:
    """The declared keys of one layout (:data:`~geomopt.optim.units.declare.LAYOUTS`)."""
    return tuple(k for k, s in state.items() if s.layout == layout)


def stacked(state: Registry = STATE) -> tuple[str, ...]:
    """The tensor state a bucket keeps stacked (entries view a row of one buffer): every declared
    key but the counts and a low-precision weight's lost bits, and an encoded moment's side entries
    (int8 block scales, an ``int8-ec`` correction)."""
    kept = tuple(k for k, s in state.items() if s.layout not in (COUNT, WEIGHT))
    return kept + tuple(k + x for x in SIDE for k in moments(state))


def direction_keys(directions: Registry = DIRECTIONS) -> tuple[str, ...]:
    """The coefficients directions keep in their param group besides the ones every group has
    (:data:`GROUP_KEYS`): the union of their spec models' fields."""
    out = dict.fromkeys(c for unit in directions.values() for c in unit.coefficients)
    return tuple(k for k in out if k not in GROUP_KEYS)


#: the keys every geomopt param group has (the spec's values; ``step``, the group's step count)
GROUP_KEYS = ("rule", "lr", "weight_decay", "radius", "direction", "alpha", "nesterov", "init", "schedule",
              "on_nonfinite", "step")
#: what the spec sets in a group: every group key but the step count, and the directions' coefficients
SPEC_KEYS = GROUP_KEYS[:-1]

MOMENTS = moments()
SECOND_MOMENTS = tuple(k for k, signed in MOMENTS.items() if not signed)
FACTORS = factors()
#: state kept in the operators' layout (transposed for ``layout: in_out``) on unsharded tensors
VIEW_KEYS = keys_in(OP)
#: the previous iterate (laid out like the parameter)
PARAM_KEYS = keys_in(PARAM)
#: statistics (each dim whole, or summed out)
STAT_KEYS = keys_in(STAT)
#: what a low-precision parameter's stored form lost (:mod:`geomopt.optim.units.compensation`)
WEIGHT_KEYS = keys_in(WEIGHT)
#: per-parameter step counts (int64 tensors in the state, ints while a step computes with them),
#: equal across a bucket's tensors
COUNTS = keys_in(COUNT)
STACKED = stacked()
#: kind of state → its keys (moved together across a spec change, or not at all)
KINDS = dict(STATE_KINDS)
