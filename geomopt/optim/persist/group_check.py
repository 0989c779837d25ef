"""Checks of a state dict's param groups before :meth:`GeomOptimizer.load_state_dict` writes
anything (the rest of the checks: :mod:`geomopt.optim.persist.load_check`): each value a spec could
have set, by the validator of the spec field it came from, and the groups against the optimizer as
it was built (a direction's coefficients present, what a sharded or capturable step cannot run).
A refusal raises :class:`~geomopt.optim.persist.load_check.CheckpointError` naming the group, the key
and what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError

from geomopt.optim.engine.construction import check_capturable, check_sharded
from geomopt.optim.persist.load_check import FIX, CheckpointError, as_number, count_error, shown
from geomopt.optim.units.directions import DIRECTIONS
from geomopt.optim.units.state_keys import direction_keys
from geomopt.spec.geometries import Euclidean
from geomopt.spec.model import Hyper
from geomopt.spec.updates import Polyak
from geomopt.spec.validate import friendly


def check_group_values(groups: list) -> None:
    """A geomopt group's values, each by the validator of the spec field it came from
    (:data:`GROUP_FIELDS`: ``lr`` ≥ 0 and finite, ``radius`` > 0, ``alpha`` in (0, 1], a
    direction's kind and coefficients by its model, ``on_nonfinite`` one of its words, …), and its
    step count by :func:`count_error`: a checkpoint holds only what a spec could have set, so a
    NaN lr or a negative radius (a rule that steps uphill) is refused here, not run."""
    for i, g in enumerate(groups):
        where = f"param_groups[{i}] (rule '{g.get('rule', '?')}')"
        if "lr" not in g:
            raise CheckpointError(f"{where} has no 'lr': {FIX}")
        if "rule" in g and not isinstance(g["rule"], str):
            raise CheckpointError(f"{where}: 'rule' is {shown(g['rule'])}, not a rule's name: {FIX}")
        for key, value in g.items():
            if key in GROUP_FIELDS or key in direction_keys():
                error = group_value_error(g, key, value)
                if error is not None:
                    named, why = error
                    raise CheckpointError(f"{where}: '{named}' is {shown(g[named])}: {why} (as in a spec); set it "
                                          f"in the dict, or load an earlier checkpoint")
        if "step" in g:  # an int, or a capturable step's device count
            error = count_error(g["step"])
            if error is not None:
                raise CheckpointError(f"{where}: 'step' is {shown(g['step'])}, {error}: {FIX}")


#: a group value → (the spec model whose field validates it, the field's name); a direction's own
#: coefficients are validated by its kind's model (its unit's, :func:`direction_model`)
GROUP_FIELDS: dict = {
    "lr": (Hyper, "lr"), "weight_decay": (Hyper, "weight_decay"), "schedule": (Hyper, "schedule"),
    "on_nonfinite": (Hyper, "on_nonfinite"), "radius": (Euclidean, "radius"),
    "direction": (Hyper, "direction"),  # (its kind and coefficients: by its kind's model)
    # every group holds these three (the defaults where its direction has none): Polyak's fields
    "alpha": (Polyak, "alpha"), "nesterov": (Polyak, "nesterov"), "init": (Polyak, "init"),
}


def direction_model(kind) -> Any:
    """The spec model of a direction kind (its unit's declaration), or None for no direction."""
    return DIRECTIONS[kind].spec if isinstance(kind, str) and kind in DIRECTIONS else None


def group_value_error(group: Mapping, key: str, value: Any):
    """(the key it is about, what the spec's validator says) of ``value`` as ``group[key]``; None when
    it accepts it. A
    direction's coefficients are validated together by the model of the group's direction kind
    (its cross-field rules too, e.g. a warmup's steps and α set together); a one-element tensor (an
    lr a scheduler keeps as a tensor) is validated as its number."""
    if isinstance(value, torch.Tensor):
        number = as_number(value)
        if number is None or key != "lr":
            return key, "not a number" if key == "lr" else "not a plain value"
        value = number
    kind = group.get("direction")
    model = direction_model(kind)
    if key == "direction":
        if model is None:
            return key, f"not a direction (one of {', '.join(DIRECTIONS)})"
        # (a coefficient missing, as in a checkpoint from before groups held them, is the spec's:
        # :func:`check_built_for`)
        fields = {k: group[k] for k in model.model_fields if k != "kind" and k in group}
        return _validation_error(model, dict(fields, kind=kind), key)
    if model is not None and key in model.model_fields:
        return None  # validated with its direction
    if key not in GROUP_FIELDS:
        return None  # another direction's coefficient (a group keeps the spec's values of its own only)
    spec_model, field = GROUP_FIELDS[key]
    if value is None:  # (a rule's field is optional, the default filling it: a group holds the value)
        return key, "no value (a group holds each value resolved)"
    return _validation_error(spec_model, {field: value}, key)


def check_built_for(opt, groups: list) -> None:
    """The loaded groups on the optimizer as it was built: the checks its constructor makes of
    the spec's values (:mod:`geomopt.optim.engine.construction`: dion on sharded tensors, what a
    capturable step cannot run) hold for them, and a storm direction needs an optimizer built
    with one (it evaluates the closure at the previous iterate, decided at construction)."""
    for i, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        model = DIRECTIONS[g["direction"]].spec
        # what the group lacks the loader takes from this optimizer's group (the spec's values)
        missing = [k for k in model.model_fields if k != "kind" and k not in g and k not in mine]
        if missing:
            raise CheckpointError(f"param_groups[{i}] (rule '{g.get('rule', '?')}'): 'direction' is "
                                  f"{g['direction']!r} without its coefficients {missing} (a group holds every "
                                  f"value its direction reads): add them, or set the direction the spec sets")
        if g.get("direction") == "storm" and not opt.engine.options.keeps_prev:
            raise CheckpointError(f"param_groups[{i}] (rule '{g.get('rule', '?')}'): 'direction' is 'storm', which "
                                  f"this optimizer was not built for (its spec has no storm direction): set the "
                                  f"spec's direction to storm, or the group's to what the spec sets")
    try:
        check_sharded(groups, opt.engine.plans, opt.engine.options)
        check_capturable(groups, opt.engine.plans, opt.engine.options)
    except ValueError as err:
        raise CheckpointError(f"the state's param_groups: {err}") from None


def _validation_error(model, data: dict, key: str):
    """(the group key, the first message) of ``model``'s validation of ``data``: the key is the
    field the error points at where the group holds it, else ``key``; None when it validates."""
    try:
        model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(x) for x in first["loc"]]
        named = loc[0] if loc and loc[0] in data and loc[0] != "kind" else key
        rest = ".".join(loc[1:])
        return named, friendly(first["type"], first["msg"]) + (f" (at {rest})" if rest else "")
    return None
