"""torchtitan's optimizer configuration naming a geomopt spec: ``optimizer_name="geomopt:muon"``.

torchtitan (0.3) builds its optimizers from an ``OptimizersContainer.Config``: ``param_groups``
route parameters by regex (first match wins) to an ``optimizer_name`` with ``optimizer_kwargs``,
and the trainer calls ``config.optimizer.build(model_parts=...)``, which constructs the class
that owns the Config (torchtitan 0.3 has no ``build_optimizers`` function any more; that call is
its builder). :class:`GeomOptimizersContainer` is torchtitan's container with one more kind of
name, ``"geomopt:<spec>"``, a shipped spec's name or a path to a ``.yaml``/``.yml``/``.geom`` file
(relative to the working directory): in each model part, the parameters its groups claim are
optimized by one :class:`geomopt.GeomOptimizer` built from their (name, parameter) pairs, under
torchtitan's canonical names (what its checkpoints key the state by), and the spec's rules route
them. Usage::

    from geomopt.integrations.torchtitan import geomopt_optimizer
    config = llama3_debugmodel()                    # any torchtitan Trainer.Config
    config.optimizer = geomopt_optimizer("muon")    # or "path/to/spec.yaml", lr=..., weight_decay=...

which is ``GeomOptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*",
optimizer_name="geomopt:muon", optimizer_kwargs={})])``; other groups may keep torchtitan's own
optimizers (``"AdamW"``), e.g. a first group sending the norms to AdamW.

Why the spec is named in ``optimizer_name``: it is the field of torchtitan's config that says which
optimizer a parameter gets, so everything else stays torchtitan's: the config schema (overrides of
``optimizer_name`` and ``optimizer_kwargs`` keep working), the regex routing, the container's
flat FQN-keyed ``state_dict`` / ``load_state_dict`` (it is ``Stateful``), its step pre-hooks and
the ``LRSchedulersContainer`` (a LambdaLR over each GeomOptimizer's per-rule groups). A subclass
is needed because torchtitan resolves names from a fixed table (Adam, AdamW, DistMuon).

``optimizer_kwargs`` may hold ``lr`` and ``weight_decay`` only: each becomes the spec's default
where the spec sets none, so a rule's own value, then the spec's ``defaults``, win (muon sets
lr 0.02 for hidden matrices and 0.001 for its Adam rules; one config lr does not overwrite them,
and a value the spec shadows is logged). Other hyper-parameters (betas, momentum) are the spec's.
The container's ``implementation`` (fused, foreach) does not apply to geomopt groups;
``optimizer_factory_kwargs_by_name["geomopt:<spec>"]`` are GeomOptimizer's keyword arguments
(``track_gap``, ``implementation``, ``roles``, …). Roles are guessed from names and shapes (the
optimizer sees (name, parameter) pairs, not the modules): ``geomopt rule roles`` shows them, and a
spec's ``roles:`` pins any it should not guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.tools.logging import logger

from geomopt.optim.engine.optimizer import GeomOptimizer
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.extends import shipped_specs
from geomopt.spec.model import Spec
from geomopt.spec.validate import load_spec

__all__ = ["PREFIX", "GeomOptimizersContainer", "geomopt_optimizer", "spec_of"]

#: what an ``optimizer_name`` naming a geomopt spec starts with
PREFIX = "geomopt:"
_HYPER = ("lr", "weight_decay")  # optimizer_kwargs that become the spec's defaults
_IMPLEMENTATION = ("fused", "foreach")  # what the container adds to every group, for torch's optimizers
_WHAT_TO_WRITE = ("write optimizer_name='geomopt:<spec>' with a shipped spec's name ({names}) or a path to a "
                  ".yaml, .yml or .geom file, e.g. 'geomopt:muon' or 'geomopt:specs/my-spec.yaml'")


def _load(optimizer_name: str) -> Spec:
    """The spec ``"geomopt:<spec>"`` names; a ValueError saying what to write otherwise."""
    what = _WHAT_TO_WRITE.format(names=", ".join(shipped_specs()))
    if not optimizer_name.startswith(PREFIX):
        raise ValueError(f"optimizer_name {optimizer_name!r} names no geomopt spec: {what}")
    ref = optimizer_name[len(PREFIX):].strip()
    if not ref:
        raise ValueError(f"optimizer_name {optimizer_name!r} names no spec after 'geomopt:': {what}")
    try:
        return load_spec(ref)
    except SpecError as err:
        raise ValueError(f"optimizer_name {optimizer_name!r}: {err}\n{what}") from None


def spec_of(optimizer_name: str, optimizer_kwargs: Optional[dict[str, Any]] = None) -> Spec:
    """The spec ``optimizer_name`` (``"geomopt:<shipped name or path>"``) names, with the ``lr`` and
    ``weight_decay`` of ``optimizer_kwargs`` as its defaults where the spec sets none (the spec's
    own values win; a shadowed one is logged). Raises ValueError, saying what to write, for a name
    that is not ``geomopt:`` and a spec that does not load, and for any other keyword."""
    spec = _load(optimizer_name)
    kwargs = {k: v for k, v in (optimizer_kwargs or {}).items() if k not in _IMPLEMENTATION}
    unknown = sorted(set(kwargs) - set(_HYPER))
    if unknown:
        raise ValueError(
            f"optimizer_kwargs of {optimizer_name!r} may hold only lr and weight_decay (the spec's defaults where it "
            f"sets none), not {', '.join(unknown)}: the spec's rules set the other hyper-parameters; a GeomOptimizer "
            f"argument goes in optimizer_factory_kwargs_by_name[{optimizer_name!r}]")
    updates = {}
    for key, value in kwargs.items():
        value = float(value)  # torchtitan allows a 0-d tensor lr
        own = getattr(spec.defaults, key)
        if own is None:
            updates[key] = value
        elif own != value:
            logger.warning(f"{optimizer_name}: the spec sets {key} {own} in its defaults, so optimizer_kwargs "
                           f"{key}={value} is not used")
    if updates:
        spec = spec.model_copy(update={"defaults": spec.defaults.model_copy(update=updates)})
    return spec


def _build_geomopt(optimizer_name: str, param_groups: list[dict[str, Any]], **geomopt_kwargs: Any) -> GeomOptimizer:
    """The factory of a ``geomopt:`` name: one GeomOptimizer over every group torchtitan made for it
    in one model part (the groups of the patterns naming it, each with params and param_names)."""
    kwargs = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in param_groups]
    if any(k != kwargs[0] for k in kwargs[1:]):
        raise ValueError(f"the param_groups naming {optimizer_name!r} give different optimizer_kwargs ({kwargs}): "
                         f"one GeomOptimizer runs them all, so give them the same (the spec's rules tell tensors "
                         f"apart)")
    named = [(name, p) for g in param_groups for name, p in zip(g["param_names"], g["params"])]
    return GeomOptimizer(named, spec_of(optimizer_name, kwargs[0]), **geomopt_kwargs)


class GeomOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose ``param_groups`` may also name a geomopt spec,
    ``optimizer_name="geomopt:<spec>"``: each model part's parameters of those groups get one
    :class:`geomopt.GeomOptimizer` (see the module's docstring). Built like torchtitan's,
    ``GeomOptimizersContainer.Config(...).build(model_parts=[...])``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config``, whose ``build(model_parts=...)`` makes a
        :class:`GeomOptimizersContainer`; a Trainer.Config's ``optimizer`` field takes it."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        """``geomopt:<spec>`` builds a GeomOptimizer; other names are torchtitan's (Adam, AdamW, DistMuon)."""
        if name.startswith(PREFIX):
            return partial(_build_geomopt, name)
        try:
            return OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            what = _WHAT_TO_WRITE.format(names=", ".join(shipped_specs()))
            raise ValueError(f"optimizer_name {name!r} is neither one of torchtitan's optimizers (Adam, AdamW, "
                             f"DistMuon) nor a geomopt spec: {what}") from None

    def _log_optimizer(self, optimizer: torch.optim.Optimizer, part_idx: int, patterns: list[str]) -> None:
        """One line per rule for a GeomOptimizer (torchtitan's logs one per param group it made)."""
        if not isinstance(optimizer, GeomOptimizer):
            return super()._log_optimizer(optimizer, part_idx, patterns)
        for group in optimizer.param_groups:
            logger.info(f"GeomOptimizer {optimizer.spec.name!r} (model_part={part_idx}) [{', '.join(patterns)}]: "
                        f"rule {group['rule']}: {len(group['params'])} params, lr {group['lr']}, "
                        f"weight_decay {group['weight_decay']}")


def geomopt_optimizer(spec: str, *, lr: Optional[float] = None, weight_decay: Optional[float] = None,
                      pattern: str = ".*", **geomopt_kwargs: Any) -> GeomOptimizersContainer.Config:
    """A config whose one param group (``pattern``, every parameter by default) runs ``spec`` (a
    shipped spec's name or a path; ``"geomopt:"`` may lead), as torchtitan's ``default_adamw`` does
    AdamW. ``lr`` and ``weight_decay`` are the spec's defaults where it sets none;
    ``geomopt_kwargs`` go to GeomOptimizer. The spec is loaded now, so a bad name fails here."""
    name = spec if spec.startswith(PREFIX) else PREFIX + spec
    kwargs = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None}
    _load(name)
    return GeomOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=name, optimizer_kwargs=kwargs)],
        optimizer_factory_kwargs_by_name={name: geomopt_kwargs} if geomopt_kwargs else {},
    )
