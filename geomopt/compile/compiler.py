"""Spec + model → :class:`Plan`: match names, check applicability, resolve every value."""

from __future__ import annotations

from typing import Optional, Union

from geomopt.compile.lint import LintContext, run_rules
from geomopt.compile.match import ParamInfo
from geomopt.compile.params import params_from_model
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.spec.diagnostics import Diagnostic, SpecError
from geomopt.spec.model import Spec, effective_prenormalize, resolve_hyper
from geomopt.spec.validate import source_of

# Findings that make a plan impossible: compile raises on these (lint reports them all).
BLOCKING = ("GO101", "GO104", "GO105")


def lint_spec(spec: Spec, params: Optional[list[ParamInfo]] = None, *, from_checkpoint: bool = False) -> list[Diagnostic]:
    """Every lint finding of ``spec`` against ``params`` (None: the spec alone), sorted by position."""
    ctx = LintContext.build(spec, params, from_checkpoint)
    return sorted(run_rules(ctx, source_of(spec)), key=lambda d: (d.line, d.col, d.code))


def compile_spec(spec: Union[Spec, str, dict], model) -> Plan:
    """Compile ``spec`` (Spec, path or dict) against ``model`` (``nn.Module`` or iterable of
    (name, tensor)). Raises :class:`SpecError` listing unmatched parameters (with the nearest rule
    patterns), inapplicable geometries and (geometry, constraint) pairs with no operator."""
    spec = as_spec(spec)
    infos, _ = params_from_model(model)
    return plan_from_infos(spec, infos)


def plan_from_infos(spec: Spec, infos: list[ParamInfo]) -> Plan:
    ctx = LintContext.build(spec, infos)
    errors = run_rules(ctx, source_of(spec), BLOCKING)
    if errors:
        raise SpecError(errors)
    params = [_param_plan(spec, ctx.owner[p.name], p) for p in ctx.params]
    return Plan(params, frozen=[p.name for p in ctx.frozen], spec_name=spec.name)


def as_spec(spec: Union[Spec, str, dict, "object"]) -> Spec:
    """A Spec from a Spec, a path (.yaml/.yml/.geom) or a plain dict."""
    from pathlib import Path

    from geomopt.spec.source import Parsed, SourceMap
    from geomopt.spec.validate import load_spec, validate

    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    if isinstance(spec, dict):
        return validate(Parsed(spec, SourceMap(file="<dict>")))
    raise TypeError(f"spec must be a Spec, a path or a dict, not {type(spec).__name__}")


def _param_plan(spec: Spec, index: int, p: ParamInfo) -> ParamPlan:
    from geomopt.geometry.scale import radius_scale

    rule = spec.rules[index]
    hyper = resolve_hyper(spec, rule)
    geometry = rule.geometry.model_dump()
    layout = geometry.get("layout", "out_in")
    if layout == "auto":
        layout = "in_out" if p.modules and "Conv1D" in p.modules else "out_in"
    transpose = layout == "in_out" and p.ndim >= 2
    if "layout" in geometry:
        geometry["layout"] = "out_in"  # the ops see the transposed tensor
    if rule.geometry.kind == "spectral":
        geometry["prenormalize"] = effective_prenormalize(rule.geometry).model_dump()
    op_shape = (p.shape[1], p.shape[0], *p.shape[2:]) if transpose else p.shape
    radius = geometry["radius"] * radius_scale(geometry, op_shape)
    constraint = rule.constraint.model_dump() if rule.constraint else None
    if constraint is not None and constraint.get("relative"):
        constraint.update(radius=constraint["radius"] * radius, relative=False)
    return ParamPlan(
        name=p.name, shape=p.shape, dtype=p.dtype, device=p.device, rule=rule.name, rule_index=index,
        geometry=geometry, constraint=constraint,
        direction=hyper["direction"].model_dump(), schedule=hyper["schedule"].model_dump(), lr=hyper["lr"],
        weight_decay=hyper["weight_decay"], radius=radius, transpose=transpose,
        on_nonfinite=hyper["on_nonfinite"], project_on_init=hyper["project_on_init"], aliases=p.aliases,
    )
