"""Spec + model → :class:`Plan`: match names, check applicability, resolve every value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

from geomopt.compile.blocking import blocking_errors
from geomopt.compile.match import ParamInfo
from geomopt.compile.ownership import Ownership
from geomopt.compile.params import params_from_model
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.compile.resolve import resolve
from geomopt.compile.roles.infer import infer_roles
from geomopt.compile.roles.assign import assign, ensure_roles
from geomopt.compile.wrappers import named_modules, unwrap
from geomopt.spec.diagnostics import SpecError
from geomopt.spec.geometries import AutoView
from geomopt.spec.model import Spec, resolve_hyper
from geomopt.spec.source import Parsed, SourceMap
from geomopt.spec.validate import gc_paused, load_spec, parse_spec, source_of, validate


def compile_spec(spec: Union[Spec, str, dict], model, *, roles: Optional[dict] = None,
                 example_inputs=None) -> Plan:
    """Compile ``spec`` (Spec, path or dict) against ``model`` (``nn.Module`` or iterable of
    (name, tensor)). ``roles``: role → name patterns, over the inferred roles and the spec's
    ``roles:``. ``example_inputs``: inputs of one forward, traced to decide roles from use
    (:func:`model_params`). Raises :class:`SpecError` listing unmatched parameters (with the
    nearest rule patterns), inapplicable geometries and views, and (geometry, constraint) pairs
    with no operator."""
    spec = as_spec(spec)
    with gc_paused():
        infos, _ = model_params(model, needs_roles(spec, roles), example_inputs)
        return plan_from_infos(spec, infos, roles=roles)


def model_params(model, roles: bool = True, example_inputs=None) -> tuple[list[ParamInfo], dict[str, object]]:
    """:func:`params_from_model`, with each tensor's role when ``roles`` (an iterable of
    (name, tensor) gets them guessed from names and shapes later, where a plan reads roles).

    Roles come from what each tensor does in one traced forward (:mod:`geomopt.compile.trace`) on
    ``example_inputs`` (a tensor, tuple, dict or callable: :func:`~geomopt.compile.trace.inputs.as_inputs`)
    or the model's own (:func:`~geomopt.compile.trace.inputs.default_inputs`: built-in and
    Hugging Face models), over the module tree's inference; with no inputs, or a forward that
    fails, from the module tree alone, each role saying why (lint GO124). Unusable
    ``example_inputs`` raise TypeError."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.compile.trace.inputs import as_inputs  # the tracer needs torch: off the lint path

    given = None if example_inputs is None else as_inputs(example_inputs)
    if not (roles and isinstance(model, torch.nn.Module)):
        return params_from_model(model)
    modules = named_modules(model)  # one walk of the tree for both, through wrappers (compile, DDP, …)
    infos, tensors = params_from_model(model, modules)
    inner = unwrap(model)
    inferred = infer_roles(inner, infos, modules)
    assign(infos, _traced_roles(inner, infos, inferred, given))
    return infos, tensors


def _traced_roles(model, infos: list[ParamInfo], inferred: dict, inputs) -> dict:
    """The trace's roles over ``inferred``, or ``inferred`` marked with why there is no trace."""
    # the tracer needs torch: off the lint path
    from geomopt.compile.roles.traced import apply_trace, untraced
    from geomopt.compile.trace.forward import TraceError, trace_model
    from geomopt.compile.trace.inputs import default_inputs

    if not infos:
        return inferred
    if inputs is None:
        try:
            inputs = default_inputs(model)
        except Exception as exc:  # noqa: BLE001 (building the model's own inputs failed: no trace, say why)
            return untraced(inferred, f"building {type(model).__name__}'s example inputs raised "
                                      f"{type(exc).__name__}: {exc}")
    if inputs is None:
        return untraced(inferred, f"no example inputs ({type(model).__name__} has no example_inputs() method and no "
                                  f"Hugging Face config)")
    try:
        trace = trace_model(model, inputs)
    except TraceError as exc:
        return untraced(inferred, f"{exc} (inputs: {inputs.source})")
    return apply_trace(infos, inferred, trace)


def needs_roles(spec: Spec, roles: Optional[dict] = None) -> bool:
    """Whether planning ``spec`` reads roles: a ``role`` match, an ``auto`` view, ``roles:``."""
    return bool(roles or spec.roles) or any(
        r.match.role is not None or ((view := getattr(r.geometry, "view", None)) is not None and view.kind == "auto")
        for r in spec.rules)


def plan_from_infos(spec: Spec, infos: list[ParamInfo], *, roles: Optional[dict] = None) -> Plan:
    """The plan of ``spec`` for tensors ``infos``; raises :class:`SpecError` on blocking findings.
    Tensors without a role get one guessed from names and shapes when the spec reads roles."""
    with gc_paused():
        if needs_roles(spec, roles):
            ensure_roles(infos, spec.roles, roles)
        return _plan_from_infos(spec, infos)


def _plan_from_infos(spec: Spec, infos: list[ParamInfo]) -> Plan:
    ctx = Ownership.match(spec, infos)
    errors = blocking_errors(ctx, source_of(spec))
    if errors:
        raise SpecError(errors)
    planners: dict[int, _RulePlanner] = {}
    params = []
    for p in ctx.params:
        i = ctx.owner[p.name]
        assert i is not None  # an unmatched or undecided tensor raised SpecError above
        planner = planners.get(i) or planners.setdefault(i, _RulePlanner(spec, i))
        params.append(planner.plan(p))
    return Plan(params, frozen=[p.name for p in ctx.frozen], spec_name=spec.name)


def as_spec(spec: Union[Spec, str, dict, "object"]) -> Spec:
    """A Spec from a Spec, a path (.yaml/.yml/.geom), a shipped spec's name (``"muon"``: a string
    with no path separator, line break or extension; :func:`geomopt.shipped_specs`), spec text (a
    string with a line break: YAML, or the DSL when it opens with ``geomopt 1``) or a plain dict.
    A spec that ``extends`` another comes back merged (:mod:`geomopt.spec.extends`)."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str) and "\n" in spec:  # no path has a line break: the text itself
        dsl = re.match(r"\ufeff?\s*(#[^\n]*\n\s*)*geomopt\s+\d", spec) is not None
        return parse_spec(spec, "dsl" if dsl else "yaml", file="<string>")
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    if isinstance(spec, dict):
        return validate(Parsed(spec, SourceMap(file="<dict>")))
    raise TypeError(f"spec must be a Spec, a path, a shipped spec's name or a dict, not {type(spec).__name__}")


class _RulePlanner:
    """Resolves one rule's values once (hyper-parameters, geometry and constraint) and each
    (shape, layout, structure) once (:func:`geomopt.compile.resolve.resolve`), so planning many
    tensors of few shapes costs little per tensor. The fragments are frozen: the plans of a rule
    share them."""

    def __init__(self, spec: Spec, index: int):
        rule = spec.rules[index]
        hyper = resolve_hyper(spec, rule)
        self.index, self.rule = index, rule
        self.lr, self.weight_decay = hyper["lr"], hyper["weight_decay"]
        self.on_nonfinite, self.project_on_init = hyper["on_nonfinite"], hyper["project_on_init"]
        self.direction = hyper["direction"]
        self.decay = hyper["decay"].kind
        self.state_dtype = hyper["state"].dtype
        self.compensation = hyper["state"].compensation
        self.factor_dtype = hyper["state"].factors
        self.post = tuple(rule.post or ())
        self.schedule = hyper["schedule"]
        self.geometry = rule.geometry
        self.constraint = rule.constraint
        self.qk_clip = rule.qk_clip
        self.auto_view = isinstance(self.geometry.get("view"), AutoView)
        self._resolved: dict = {}  # (shape, Conv1D, structure) → Ops

    def plan(self, p: ParamInfo) -> ParamPlan:
        conv1d = bool(p.modules and "Conv1D" in p.modules)
        structure = p.role.structure if p.role is not None and self.auto_view else None
        key = (p.shape, conv1d, None if structure is None else repr(structure))
        ops = self._resolved.get(key)
        if ops is None:
            ops = self._resolved[key] = resolve(self.geometry, self.constraint, p.shape, conv1d=conv1d,
                                                structure=structure, post=self.post)
        return ParamPlan(
            name=p.name, shape=p.shape, dtype=p.dtype, device=p.device, rule=self.rule.name, rule_index=self.index,
            geometry=ops.geometry, constraint=ops.constraint, direction=self.direction, schedule=self.schedule,
            lr=self.lr, weight_decay=self.weight_decay, radius=ops.radius, transpose=ops.transpose,
            on_nonfinite=self.on_nonfinite, project_on_init=self.project_on_init, aliases=p.aliases,
            role="" if p.role is None else p.role.name, post=self.post, decay=self.decay, ops=ops.digest,
            qk_clip=self.qk_clip, state_dtype=self.state_dtype, compensation=self.compensation,
            factor_dtype=self.factor_dtype,
        )
