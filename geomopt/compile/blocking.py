"""Findings that make a plan impossible: a tensor no rule owns (GO101), a geometry or view that
cannot act on a tensor it owns (GO104), a (geometry, constraint) pair with no backward operator
(GO105), a post-stage that cannot act on a tensor its rule owns (GO120), a step scalar beyond the
tensor's floating-point range (GO126, :mod:`geomopt.compile.ranges`), a state precision the rule's
state cannot be kept in (GO127). The compiler refuses a
spec with any of them; lint reports them as rules (their docstrings are the rules' docs), and a
suppression comment cannot silence them.

A check is ``fn(ownership) -> iterable of (message, path)``, as a lint rule is.
"""

from __future__ import annotations

import difflib

from geomopt.support import has_backward, supported_constraints
from geomopt.compile.match import shape_text
from geomopt.compile.ownership import Ownership
from geomopt.compile.ranges import step_overflow
from geomopt.compile.resolve import op_layout, resolve_view
from geomopt.registry import Registry
from geomopt.spec.diagnostics import Diagnostic
from geomopt.spec.model import QUANTIZED
from geomopt.spec.source import SourceMap

#: code → check; meta ``name`` (the lint rule's) and ``needs_model``
BLOCKING = Registry("blocking check")


@BLOCKING.register("GO101", name="unmatched-parameter", needs_model=True)
def unmatched_parameter(ctx: Ownership):
    """A trainable parameter that no rule matches.

    The optimizer would not know how to step it, so compile refuses the spec (a blocking error) rather than leave
    the tensor silently untrained.

    Bad::

        rules:
          - {name: hidden, match: "h.*.weight", geometry: …}     # h.0.bias is left over

    Fixed: add a catch-all last rule::

          - {name: rest, match: "**", geometry: {kind: adam}}
    """
    patterns = [r.match.name for r in ctx.spec.rules if r.match.name]
    undecided = {n for names in ctx.undecided for n in names}
    for p in ctx.params:
        if ctx.owner.get(p.name) is None and p.name not in undecided:
            near = difflib.get_close_matches(p.name, patterns, n=2, cutoff=0.3)
            hint = f"; nearest patterns: {', '.join(repr(n) for n in near)}" if near else ""
            yield (f"parameter '{p.name}' ({shape_text(p)}) is matched by no rule{hint}; add a rule for it or a "
                   f"catch-all last rule (match: \"**\")", ("rules",))


@BLOCKING.register("GO104", name="inapplicable-geometry", needs_model=True)
def inapplicable_geometry(ctx: Ownership):
    """A geometry that cannot act on a tensor it owns: spectral (or rowwise/columnwise) on a 1-D tensor, or a ``view``
    that does not fit the tensor (blocks that do not divide or sum to its rows, batch axes it lacks); or a ``dion``
    direction on a 1-D tensor or with a rank larger than the tensor's matrix (shape[0] × the rest) has room for.

    The step is undefined there (a 1-D tensor has no rows or singular values; a view that does not fit has no
    matrices to act on), so compile refuses the spec (a blocking error).

    Bad: ``match: "**"`` with ``geometry: {kind: spectral, …}`` (biases are 1-D).
    Fixed: ``match: {name: "**", ndim: 2}`` and a separate rule for the rest.
    """
    from geomopt.geometry.scale import check_applicable  # torch, and only with a model: not on the lint path

    for i, rule in enumerate(ctx.spec.rules):
        geometry = rule.geometry
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
        direction = rule.direction or ctx.spec.defaults.direction
        if direction is not None and direction.kind == "dion":
            rank_at: tuple = (("rules", i, "direction", "rank") if rule.direction is not None
                              else ("defaults", "direction", "rank"))
            for p in ctx.owned(i):
                problem = dion_problem(direction.rank, p.shape)
                if problem:
                    yield f"rule '{rule.name}': {problem} for '{p.name}' ({shape_text(p)})", rank_at


def dion_problem(rank, shape) -> str | None:
    """Why a dion direction of ``rank`` cannot run on a tensor of ``shape`` (None: it can)."""
    if len(shape) < 2:
        return "dion direction needs a matrix (a tensor of 2 or more dims)"
    m, n = shape[0], 1
    for s in shape[1:]:
        n *= s
    if isinstance(rank, int) and rank > min(m, n):
        return (f"dion rank {rank} is larger than its {m}×{n} matrix allows (at most min(m, n) = {min(m, n)}; a "
                f"fraction such as 0.25 of min(m, n) fits every shape)")
    return None


@BLOCKING.register("GO105", name="no-operator", needs_model=False)
def no_operator(ctx: Ownership):
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


@BLOCKING.register("GO120", name="inapplicable-stage", needs_model=True)
def inapplicable_stage(ctx: Ownership):
    """A post-stage that cannot act on a tensor its rule owns.

    Row or column second moments (``second_moment`` with ``axis: row``, ``column`` or ``longer``) and row or
    column normalization (``axis_norm``) need a matrix, and a 1-D tensor has none: compile refuses the spec (a
    blocking error).

    Bad: ``match: "**"`` with ``post: [{kind: second_moment, axis: row}]`` (biases are 1-D).
    Fixed: ``axis: element``, or a rule that owns only matrices (``match: {ndim: 2}``).
    """
    for i, rule in enumerate(ctx.spec.rules):
        for j, stage in enumerate(rule.post or ()):
            if stage.kind not in ("second_moment", "axis_norm") or getattr(stage, "axis", None) == "element":
                continue
            small = [p for p in ctx.owned(i) if len(p.shape) < 2]
            if small:
                names = ", ".join(f"'{p.name}' ({shape_text(p)})" for p in small[:3]) + (" …" if len(small) > 3 else "")
                axis = getattr(stage, "axis", None)
                what, field = (f"second_moment(axis={axis})", "axis") if axis else ("axis_norm", "order")
                yield (f"rule '{rule.name}': {what} normalizes rows or columns of a matrix, "
                       f"and {len(small)} tensor(s) it owns have fewer than 2 dims: {names}; "
                       f"{'use axis: element or ' if field == 'axis' else ''}match only matrices (ndim: 2)"), \
                    ("rules", i, "post", j, field)


@BLOCKING.register("GO127", name="state-precision", needs_model=False)
def state_precision(ctx: Ownership):
    """A state precision the rule's state cannot be kept in: ``state: int8`` quantizes moments (momentum, Adam's
    moments, a stage's second moment) block by block, and a STORM direction also keeps the previous gradient,
    which is not a moment.

    The gradient difference STORM adds to its estimate is as small as the step, far below an 8-bit block's
    resolution, so compile refuses the spec (a blocking error).

    Bad::

        - {name: hidden, …, direction: {kind: storm}, state: int8}

    Fixed: a precision the rule's state accepts (float32 or bfloat16)::

        - {name: hidden, …, direction: {kind: storm}, state: bfloat16}
    """
    for i, rule in enumerate(ctx.spec.rules):
        state = rule.state if rule.state is not None else ctx.spec.defaults.state
        if state is None or state.dtype not in QUANTIZED:
            continue
        direction = rule.direction if rule.direction is not None else ctx.spec.defaults.direction
        if direction is not None and direction.kind == "storm":
            path = ("rules", i, "state") if rule.state is not None else ("defaults", "state")
            yield (f"rule '{rule.name}': state {state.dtype} quantizes moments, and its storm direction also keeps the "
                   f"previous gradient; this rule's state accepts: float32, bfloat16"), path


def blocking_errors(ctx: Ownership, source: SourceMap | None) -> list[Diagnostic]:
    """The blocking findings of ``ctx`` (in the order of :data:`BLOCKING`), then the tensors only a
    ``module:`` predicate could match (GO101 too: lint notes them, GO112, but a plan cannot guess
    their rule)."""
    file = source.file if source else "<spec>"
    out = []
    for code, check in BLOCKING.items():
        for message, path in check(ctx):
            line, col = source.pos(path) if source else (1, 1)
            out.append(Diagnostic(code, BLOCKING.meta[code]["name"], "error", message, file, line, col))
    undecided = {n for names in ctx.undecided for n in names}
    names = [p.name for p in ctx.params if ctx.owner.get(p.name) is None and p.name in undecided]
    if names:
        line, col = source.pos(("rules",)) if source else (1, 1)
        shown = ", ".join(repr(n) for n in names[:5]) + (" …" if len(names) > 5 else "")
        out.append(Diagnostic("GO101", "unmatched-parameter", "error",
                              f"{len(names)} parameter(s) matched only by module predicates, which names and shapes "
                              f"cannot decide: {shown}; plan against the model (--model) or match them by name",
                              file, line, col))
    return out


BLOCKING.register("GO126", name="step-overflow", needs_model=True)(step_overflow)

__all__ = ["BLOCKING", "blocking_errors"]
