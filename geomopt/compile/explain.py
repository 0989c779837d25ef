"""Why a tensor gets its update (``geomopt explain``) and a starter spec from roles (``geomopt init``)."""

from __future__ import annotations

import math

from geomopt.compile.match import Matcher, ParamInfo, any_name, describe
from geomopt.compile.ownership import Ownership
from geomopt.compile.roles.types import TRACE_FIX
from geomopt.compile.plan import ParamPlan, call_text, geometry_text, constraint_text, view_text
from geomopt.spec.diagnostics import did_you_mean
from geomopt.spec.geometries import kronecker_side
from geomopt.spec.model import Spec
from geomopt.spec.shipped import shipped_folder

RECIPES = ("muon", "scion", "uscion", "adamw-hybrid", "hyperball", "prox-muon-frobenius", "spectral-clip", "stiefel")


def _predicates(match, p: ParamInfo) -> list[str]:
    """Each predicate of a rule's match that fails for ``p``, said in words."""
    why = []
    one = Matcher(match)
    if match.name is not None and not any_name(one.fullmatch, p):
        why.append(f"name does not match {match.name!r}")
    if one.ndims is not None and len(p.shape) not in one.ndims:
        why.append(f"ndim {len(p.shape)} not in {sorted(one.ndims)}")
    if one.shape is not None and not one._shape_ok(p.shape):
        why.append(f"shape {list(p.shape)} ≠ {list(match.shape)}")
    if one.roles is not None and not one._role_ok(p):
        have = p.role.name if p.role is not None else "unknown"
        why.append(f"role {have} not in {sorted(one.roles)}")
    if match.module is not None:
        if p.modules is None:
            why.append(f"module={match.module} cannot be decided (no model)")
        elif match.module not in p.modules:
            why.append(f"module {p.modules[0] if p.modules else 'none'} is not {match.module}")
    return why


def _nearest(name: str, names: list[str]) -> str:
    """What ``name`` may have meant: the parameters it begins (``rnn.weight`` → all of
    ``rnn.weight_ih_l0``, ``rnn.weight_hh_l0`` …, not one picked by spelling), else the closest
    spelling."""
    under = [n for n in names if n.startswith(name)]
    if len(under) == 1:
        return f"; did you mean {under[0]!r}?"
    if under:
        shown = ", ".join(repr(n) for n in under[:6]) + (f" … ({len(under)} in all)" if len(under) > 6 else "")
        return f"; {len(under)} parameter names begin with it: {shown}"
    return did_you_mean(name, names)


def explain(spec: Spec, infos: list[ParamInfo], plan_params: list[ParamPlan], name: str) -> str:
    """The text ``geomopt explain`` prints for tensor ``name`` (any of its tied names)."""
    p = next((q for q in infos if q.name == name or name in q.aliases), None)
    if p is None:
        names = [q.name for q in infos] + [a for q in infos for a in q.aliases]
        raise KeyError(f"the model has no parameter {name!r}{_nearest(name, names)}")
    pp = next((q for q in plan_params if q.name == p.name), None)
    shape = "×".join(map(str, p.shape)) or "scalar"
    lines = [f"parameter  {p.name}" + (f" (= {', '.join(p.aliases)})" if p.aliases else "") + f"  {shape} {p.dtype}"]
    if p.role is not None:
        role = p.role
        basis = ("guessed from names and shapes" if role.guessed else
                 "traced" if role.basis == "trace" else
                 "inferred without a trace" if role.untraced else role.basis)
        lines.append(f"role       {role.name} ({basis}): {role.evidence}")
        if role.inferred:
            lines.append(f"           the module tree said {role.inferred}; the trace wins")
        if role.untraced:
            lines.append(f"           no trace: {role.untraced}; {TRACE_FIX}")
        if role.structure:
            lines.append(f"structure  {role.structure}")
    if not p.requires_grad:
        lines.append("frozen     requires_grad=False: the optimizer skips it")
        return "\n".join(lines) + "\n"
    lines.append("rules")
    owner = None
    for i, rule in enumerate(spec.rules):
        why = _predicates(rule.match, p)
        where = f"  {i + 1}. {rule.name:<14} match {describe(rule.match):<36}"
        if why:
            lines.append(f"{where} no: {'; '.join(why)}")
        elif owner is None:
            owner = i
            lines.append(f"{where} yes: owns it (the first rule that matches)")
        else:
            lines.append(f"{where} matches too, but '{spec.rules[owner].name}' came first")
    if pp is None:
        lines.append("plan       none: no rule owns it (lint: GO101)")
        return "\n".join(lines) + "\n"
    g = pp.geometry
    spec_view = getattr(spec.rules[pp.rule_index].geometry, "view", None)
    lines.append(f"view       {view_text(pp)}" + (" (view: auto, from the structure)" if spec_view is not None
                                                   and spec_view.kind == "auto" else ""))
    if g.view is not None and g.view.factors:
        lines.append(f"           block radius factors {[round(f, 4) for f in g.view.factors]}")
    extra = []
    if g.get("prenormalize"):
        extra.append(f"prenormalize {call_text(g['prenormalize'])}")
    if g.get("scale", "none") != "none":
        extra.append(f"scale {g['scale']}")
    if pp.transpose:
        extra.append("acts on the transpose (layout in_out)")
    lines.append(f"forward    {geometry_text(pp)}" + (f"; {', '.join(extra)}" if extra else ""))
    if g.kind == "kronecker":
        lines.append(f"factors    {kronecker_factors_text(pp)}")
    if pp.post:
        lines.append(f"post       {' → '.join(call_text(s) for s in pp.post)} (on the forward's update, before ρ)")
    lines.append(f"backward   {constraint_text(pp)}")
    if pp.constraint and pp.constraint.get("method") == "auto" and g.kind == "spectral":
        from geomopt.geometry.method import AUTO_RULE  # geomopt.geometry loads torch: off the lint path

        lines.append(f"           method auto on {pp.device}: {AUTO_RULE}; exact or polar forces one")
    lines.append(f"direction  {call_text(pp.direction)}; schedule {call_text(pp.schedule)}")
    lines.append(f"lr         {pp.lr:g}; weight decay {pp.weight_decay:g}"
                 + (f" ({pp.decay})" if pp.weight_decay else ""))
    scale = pp.radius / g.radius if g.radius else math.nan
    lines.append(f"radius     {pp.radius:.4g} (geometry radius {g.radius:g} × preset {scale:.4g}); "
                 f"step size lr·radius = {pp.lr * pp.radius:.4g}")
    return "\n".join(lines) + "\n"


def kronecker_factors_text(pp: ParamPlan) -> str:
    """The factor a kronecker rule keeps on each side of the tensor's matrices (the (shape[0], rest)
    one, or its view's, which are of one shape: each keeps its own)."""
    from geomopt.geometry.view import count, matrix_shapes  # geomopt.geometry loads torch: off the lint path

    g = pp.geometry
    view = g.view
    rows, cols = matrix_shapes(view, pp.op_shape)[0]
    head = f"{count(view, pp.op_shape)} matrices, each: " if view is not None else ""
    out = []
    for name, k in (("left", rows), ("right", cols)):
        side = kronecker_side(g["method"], k, g["max_dim"])
        text = {"full": f"{k}×{k}", "triangular": f"{k}×{k} triangular", "diagonal": f"diagonal of {k}",
                "none": f"none (identity; {k} > max_dim)"}
        out.append(f"{name} {text[side]}")
    return head + ", ".join(out)


def recipe(name: str) -> str:
    """The text of a shipped spec by name."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}{did_you_mean(name, RECIPES)}; recipes: {', '.join(RECIPES)}")
    return (shipped_folder("specs") / f"{name}.yaml").read_text(encoding="utf-8")


def starter(spec: Spec, infos: list[ParamInfo], model_name: str) -> Spec:
    """``spec`` (a recipe) without the rules this model leaves idle (roles it does not have), named
    for the model: a spec that lints clean against it."""
    ctx = Ownership.match(spec, infos)
    keep = [r for i, r in enumerate(spec.rules) if ctx.matched[i]]
    return spec.model_copy(update={"rules": keep,
                                   "name": f"{spec.name}-{model_name}".replace(":", "-").replace(".", "-"),
                                   "description": f"{spec.name} for {model_name}, from `geomopt init`"})


def role_summary(infos: list[ParamInfo]) -> str:
    """"12 hidden, 2 embedding, …" in order of count."""
    counts: dict[str, int] = {}
    for p in infos:
        if p.role is not None:
            counts[p.role.name] = counts.get(p.role.name, 0) + 1
    return ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))


__all__ = ["RECIPES", "explain", "recipe", "role_summary", "starter"]
