"""Applicability: can the declared operators act at all? GO104 a geometry (or its view) that
cannot act on a tensor it owns, GO105 a (geometry, constraint) pair with no backward operator,
GO120 a post-stage that cannot act on a tensor its rule owns. All three are blocking errors
(:data:`geomopt.compile.compiler.BLOCKING`): compile refuses the spec, and a suppression comment
cannot silence them.
"""

from __future__ import annotations

from geomopt.catalog import has_backward, supported_constraints
from geomopt.lint.context import LintContext, lint_rule, shape_text


@lint_rule("GO104", "inapplicable-geometry", "error", needs_model=True)
def inapplicable_geometry(ctx: LintContext):
    """A geometry that cannot act on a tensor it owns: spectral (or rowwise/columnwise) on a 1-D tensor, or a ``view``
    that does not fit the tensor (blocks that do not divide or sum to its rows, batch axes it lacks).

    The step is undefined there (a 1-D tensor has no rows or singular values; a view that does not fit has no
    matrices to act on), so compile refuses the spec (a blocking error).

    Bad: ``match: "**"`` with ``geometry: {kind: spectral, …}`` (biases are 1-D).
    Fixed: ``match: {name: "**", ndim: 2}`` and a separate rule for the rest.
    """
    from geomopt.compile.resolve import op_layout, resolve_view
    from geomopt.geometry.scale import check_applicable

    for i, rule in enumerate(ctx.spec.rules):
        geometry = rule.geometry.model_dump()
        view_path = ("rules", i, "geometry", "view")
        problems: dict = {}
        for p in ctx.owned(i):
            structure = p.role.structure if p.role is not None else None
            key = (p.shape, p.modules and "Conv1D" in p.modules, repr(structure))
            if key not in problems:
                problem = check_applicable(geometry, p.shape)
                if problem is None and geometry.get("view") is not None:
                    op_geometry, _, op_shape = op_layout(geometry, p)
                    try:
                        resolve_view(op_geometry, op_shape, structure)
                    except ValueError as exc:
                        problem = str(exc)
                problems[key] = (problem, problem is not None and geometry.get("view") is not None
                                 and check_applicable(geometry, p.shape) is None)
            problem, in_view = problems[key]
            if problem:
                at = view_path if in_view else ("rules", i, "geometry", "kind")
                yield f"rule '{rule.name}': {problem} for '{p.name}' ({shape_text(p)})", at


@lint_rule("GO105", "no-operator", "error")
def no_operator(ctx: LintContext):
    """A (geometry, constraint) pair with no backward operator (paper Table 1 lists the pairs).

    The backward step, which keeps the tensor in the constraint's set under that geometry, has no operator for the
    pair: there is no step to take, so compile refuses the spec (a blocking error).

    Bad: ``geometry: {kind: spectral}`` with ``constraint: {kind: l0, k: 10}``.
    Fixed: a constraint the geometry supports, e.g. ``rank``, or an anisotropic geometry for ``l0``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.constraint is None:
            continue
        g, c = rule.geometry.kind, rule.constraint.kind
        if not has_backward(g, c):
            have = supported_constraints(g)
            yield (f"no backward operator for {g} geometry with {c} constraint; {g} supports: "
                   f"{', '.join(have) if have else 'no constraints'}"), ("rules", i, "constraint", "kind")


@lint_rule("GO120", "inapplicable-stage", "error", needs_model=True)
def inapplicable_stage(ctx: LintContext):
    """A post-stage that cannot act on a tensor its rule owns.

    Row or column second moments (``second_moment`` with ``axis: row`` or ``column``) need a matrix, and a 1-D
    tensor has none: compile refuses the spec (a blocking error).

    Bad: ``match: "**"`` with ``post: [{kind: second_moment, axis: row}]`` (biases are 1-D).
    Fixed: ``axis: element``, or a rule that owns only matrices (``match: {ndim: 2}``).
    """
    for i, rule in enumerate(ctx.spec.rules):
        for j, stage in enumerate(rule.post or ()):
            if stage.kind != "second_moment" or stage.axis == "element":
                continue
            small = [p for p in ctx.owned(i) if len(p.shape) < 2]
            if small:
                names = ", ".join(f"'{p.name}' ({shape_text(p)})" for p in small[:3]) + (" …" if len(small) > 3 else "")
                yield (f"rule '{rule.name}': second_moment(axis={stage.axis}) normalizes rows or columns of a matrix, "
                       f"and {len(small)} tensor(s) it owns have fewer than 2 dims: {names}; use axis: element or "
                       f"match only matrices (ndim: 2)"), ("rules", i, "post", j, "axis")
