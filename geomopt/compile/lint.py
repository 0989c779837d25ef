"""Lint rules: each a small registered unit with a code, a kebab-case name, a severity and a
docstring (with a bad and a fixed example) that ``geomopt rule CODE`` prints.

A rule is ``fn(ctx) -> iterable of (message, path)``; ``path`` locates the finding in the spec
source (``("rules", 2, "constraint")``). Rules never raise for a bad spec: they report.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Callable, Iterable, Optional

from geomopt.catalog import has_backward, realized_reference, supported_constraints
from geomopt.compile.match import Matcher, ParamInfo, any_name, describe, glob_regex
from geomopt.compile.plan import op_layout
from geomopt.spec.diagnostics import LANGUAGE_CODES, Diagnostic
from geomopt.spec.model import Spec
from geomopt.spec.source import SourceMap


@dataclasses.dataclass(frozen=True)
class LintRule:
    code: str
    name: str
    severity: str
    fn: Callable
    needs_model: bool = False

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()


RULES: dict[str, LintRule] = {}


def lint_rule(code: str, name: str, severity: str, *, needs_model: bool = False):
    """Register ``fn`` under ``code``; ``needs_model`` rules run only when linting against a model
    or a checkpoint."""

    def register(fn):
        RULES[code] = LintRule(code, name, severity, fn, needs_model)
        return fn

    return register


@dataclasses.dataclass
class LintContext:
    spec: Spec
    params: list[ParamInfo]  # trainable tensors, ties collapsed
    frozen: list[ParamInfo]
    owner: dict[str, Optional[int]]  # parameter name → index of the rule that owns it
    matched: list[list[str]]  # per rule: every parameter it matches (owned or not)
    undecided: list[list[str]]  # per rule: parameters a module predicate could not decide
    from_checkpoint: bool = False
    has_model: bool = True
    owned_by: Optional[list[list[ParamInfo]]] = None  # per rule: the parameters it owns

    @classmethod
    def build(cls, spec: Spec, params: Optional[list[ParamInfo]], from_checkpoint: bool = False) -> "LintContext":
        """``params`` None: lint the spec alone (rules that need a model are skipped).

        Matching runs rule by rule over all tensors (:meth:`Matcher.select`), so its cost is one
        regex call per (rule, name), not a Python call per pair."""
        has_model = params is not None
        params = params or []
        if any(p.role is None for p in params) and (spec.roles or any(r.match.role is not None for r in spec.rules)):
            from geomopt.compile.roles import ensure_roles

            ensure_roles(params, spec.roles)
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        owner_index: list[Optional[int]] = [None] * len(trainable)
        matched: list[list[str]] = []
        undecided: list[list[str]] = []
        for i, rule in enumerate(spec.rules):
            if not trainable:  # the spec alone: nothing to match (and no pattern to compile)
                matched.append([])
                undecided.append([])
                continue
            hits, unknown = Matcher(rule.match).select(trainable)
            for j in hits:
                if owner_index[j] is None:
                    owner_index[j] = i
            matched.append([trainable[j].name for j in hits])
            undecided.append([trainable[j].name for j in unknown])
        owned_by: list[list[ParamInfo]] = [[] for _ in spec.rules]
        for p, i in zip(trainable, owner_index):
            if i is not None:
                owned_by[i].append(p)
        owner = {p.name: i for p, i in zip(trainable, owner_index)}
        return cls(spec, trainable, frozen, owner, matched, undecided, from_checkpoint, has_model, owned_by)

    def owned(self, i: int) -> list[ParamInfo]:
        if self.owned_by is not None:
            return self.owned_by[i]
        return [p for p in self.params if self.owner.get(p.name) == i]


def run_rules(ctx: LintContext, source: Optional[SourceMap], codes: Optional[Iterable[str]] = None) -> list[Diagnostic]:
    wanted = set(codes) if codes is not None else None
    file = source.file if source else "<spec>"
    out = []
    for code, rule in RULES.items():
        if (wanted is not None and code not in wanted) or (rule.needs_model and not ctx.has_model):
            continue
        for message, path in rule.fn(ctx):
            line, col = source.pos(path) if source else (1, 1)
            out.append(Diagnostic(code, rule.name, rule.severity, message, file, line, col))
    return out


def _shape(p: ParamInfo) -> str:
    return "×".join(map(str, p.shape)) or "scalar"


# ---------------------------------------------------------------- model coverage


@lint_rule("GO101", "unmatched-parameter", "error", needs_model=True)
def unmatched_parameter(ctx: LintContext):
    """A trainable parameter that no rule matches: the optimizer would not know how to step it.

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
            yield (f"parameter '{p.name}' ({_shape(p)}) is matched by no rule{hint}; add a rule for it or a "
                   f"catch-all last rule (match: \"**\")", ("rules",))


@lint_rule("GO102", "unused-rule", "warning", needs_model=True)
def unused_rule(ctx: LintContext):
    """A rule that matches no parameter of the model: usually a misspelled pattern.

    Bad: ``match: "transformer.h.*.attn.weight"`` on a model whose weights are
    ``transformer.h.0.attn.c_attn.weight``. Fixed: ``match: "transformer.h.*.attn.*.weight"``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if not ctx.matched[i] and not ctx.undecided[i] and not _absent_role(ctx, rule):
            yield f"rule '{rule.name}' ({describe(rule.match)}) matches no parameter", ("rules", i, "match")


@lint_rule("GO103", "shadowed-rule", "warning", needs_model=True)
def shadowed_rule(ctx: LintContext):
    """A rule whose every match is already owned by earlier rules (the first match wins). Not
    reported for a role rule whose only matches are tied tensors with several roles (GPT-2's
    ``wte`` = ``lm_head`` is an embedding and a head: the embedding rule owns it, GO111 says so).

    Bad: a catch-all ``match: "**"`` before ``match: "*.bias"``. Fixed: put specific rules first.
    """
    roles = {p.name: p.role for p in ctx.params}
    for i, rule in enumerate(ctx.spec.rules):
        if rule.match.role is not None and all(roles.get(n) is not None and len(roles[n].roles) > 1
                                               for n in ctx.matched[i]):
            continue
        if ctx.matched[i] and all(ctx.owner[n] is not None and ctx.owner[n] < i for n in ctx.matched[i]):
            earlier = sorted({ctx.spec.rules[ctx.owner[n]].name for n in ctx.matched[i]})
            yield (f"rule '{rule.name}' is shadowed: all {len(ctx.matched[i])} parameters it matches are owned by "
                   f"earlier rule(s) {', '.join(earlier)}; move it up or narrow them"), ("rules", i, "match")


@lint_rule("GO110", "frozen-parameters", "note", needs_model=True)
def frozen_parameters(ctx: LintContext):
    """Parameters with ``requires_grad=False`` are skipped: the optimizer never sees them.

    This is information, not a problem; unfreeze the parameters if they should train.

    Example: after ``model.transformer.wte.weight.requires_grad_(False)`` (a frozen embedding
    table) ``geomopt lint --model …`` notes ``1 frozen parameter(s) skipped: transformer.wte.weight``
    and the plan has no entry for it.
    """
    if ctx.frozen:
        names = [p.name for p in ctx.frozen]
        yield f"{len(names)} frozen parameter(s) skipped: {', '.join(names[:5])}" + (" …" if len(names) > 5 else ""), ("rules",)


@lint_rule("GO111", "tied-parameters", "note", needs_model=True)
def tied_parameters(ctx: LintContext):
    """One tensor under several names (tied embeddings) is planned and stepped once, under its
    first name. A rule that matches any of its names (or the module owning any of them) matches
    the tensor; the first such rule owns it, as for any parameter.

    Example: GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; with an embeddings rule
    (``module: Embedding``) before a head rule (``match: "lm_head.weight"``) the shared tensor
    takes the embedding geometry. Put the head rule first to give it the head's.
    """
    for p in ctx.params:
        if p.aliases:
            yield f"'{p.name}' is tied to {', '.join(repr(a) for a in p.aliases)}: planned once, by its first name", ("rules",)


@lint_rule("GO112", "undecidable-module", "note", needs_model=True)
def undecidable_module(ctx: LintContext):
    """A ``module:`` predicate cannot be checked against a checkpoint (it stores names and shapes,
    not module types): lint against the model (``--model``) to check it.

    Example: ``match: {module: Embedding}`` linted with ``--checkpoint model.safetensors`` notes
    the rule; ``--model pkg.module:factory`` decides it, or match by name instead
    (``match: "transformer.wt?.weight"``). ``geomopt plan`` refuses tensors that only such a rule
    could match.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if ctx.undecided[i]:
            yield (f"rule '{rule.name}' tests module={rule.match.module}, unknown for {len(ctx.undecided[i])} "
                   f"checkpoint tensor(s); lint with --model to check it"), ("rules", i, "match", "module")


# ---------------------------------------------------------------- geometry and constraint


@lint_rule("GO104", "inapplicable-geometry", "error", needs_model=True)
def inapplicable_geometry(ctx: LintContext):
    """A geometry that cannot act on a tensor it owns: spectral (or rowwise/columnwise) on a 1-D
    tensor, or a ``view`` that does not fit the tensor (blocks that do not divide or sum to its
    rows, batch axes it lacks).

    Bad: ``match: "**"`` with ``geometry: {kind: spectral, …}`` (biases are 1-D).
    Fixed: ``match: {name: "**", ndim: 2}`` and a separate rule for the rest.
    """
    from geomopt.compile.plan import resolve_view
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
                yield f"rule '{rule.name}': {problem} for '{p.name}' ({_shape(p)})", at


@lint_rule("GO105", "no-operator", "error")
def no_operator(ctx: LintContext):
    """A (geometry, constraint) pair with no backward operator (paper Table 1 lists the pairs).

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


def _field(model, name: str, default=None):
    """A spec model's field, or ``default`` where its kind has none (a plain lookup: ``getattr``
    on a field a model lacks goes through pydantic's slow ``__getattr__``)."""
    return model.__dict__.get(name, default)


def _eps_paths(rule, i):
    g = rule.geometry
    ref = _field(g, "reference")
    if ref is not None and _field(ref, "eps") is not None:
        yield ref.eps, ("rules", i, "geometry", "reference", "eps")
    pre = _field(g, "prenormalize")
    if pre is not None and _field(pre, "eps") is not None:
        yield pre.eps, ("rules", i, "geometry", "prenormalize", "eps")
    if g.kind == "adam":
        yield g.eps, ("rules", i, "geometry", "eps")


@lint_rule("GO106", "dubious-value", "warning")
def dubious_value(ctx: LintContext):
    """Values that are legal but numerically dubious: an ε below 1e-12 (below float32 resolution of
    the quantities it guards) or a scale preset that shrinks a radius below 1e-4 of its value
    (updates vanish; e.g. ``scale: scion`` on a sign geometry of a 50k-wide embedding).

    Bad: ``reference: {kind: log_barrier, eps: 1.0e-20}``. Fixed: ``eps: 1.0e-8``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        for eps, path in _eps_paths(rule, i):
            if eps < 1e-12:
                yield f"eps={eps:g} is below 1e-12: float32 cannot resolve it; use ≥ 1e-12 (1e-8 is usual)", path
        owned = ctx.owned(i)
        if owned and _field(rule.geometry, "scale", "none") != "none":
            from geomopt.geometry.scale import radius_scale  # torch: only with a model

            geometry = rule.geometry.model_dump()
            for p in owned:
                op_geometry, _, op_shape = op_layout(geometry, p)  # the shape the compiled plan scales by
                try:
                    s = radius_scale(op_geometry, op_shape)
                except (ValueError, ZeroDivisionError):
                    continue
                if s < 1e-4:
                    yield (f"scale={rule.geometry.scale} multiplies the radius by {s:.2g} for '{p.name}' "
                           f"({_shape(p)}): its updates nearly vanish"), ("rules", i, "geometry", "scale")
                    break


_H_DEPENDENT = {"l2_ball", "frobenius_ball", "frobenius_sphere"}


@lint_rule("GO107", "reference-approx-mismatch", "warning")
def reference_approx_mismatch(ctx: LintContext):
    """Newton–Schulz and Polar Express realize the spectral power barrier κ = 4 with ε ≈ 1/∏aᵢ
    (paper Appendix F, Theorem 4.7), not the declared reference. Under a constraint whose backward
    step depends on h (ℓ2 / Frobenius ball and sphere) the declared reference is what the step uses,
    so a mismatch makes forward and backward disagree.

    Bad: ``reference: {kind: log_barrier}`` with ``approx: {kind: polar_express, steps: 5}`` and
    ``constraint: {kind: frobenius_ball}``. Fixed: ``reference: {kind: power_barrier, kappa: 4,
    eps: 1.05e-3}`` (what PE-5 realizes), or ``approx: {kind: svd}``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        g = rule.geometry
        if g.kind != "spectral" or rule.constraint is None or rule.constraint.kind not in _H_DEPENDENT:
            continue
        realized = realized_reference(g.approx.model_dump())
        if realized is None:
            continue
        ref = g.reference
        ok = (ref.kind == "power_barrier" and abs(ref.kappa - realized["kappa"]) < 1e-9
              and abs(math.log(ref.eps / realized["eps"])) < math.log(2))
        if not ok:
            yield (f"rule '{rule.name}': {g.approx.kind}({g.approx.steps} steps) realizes power_barrier(kappa=4, "
                   f"eps≈{realized['eps']:.3g}) but the {rule.constraint.kind} step uses the declared "
                   f"{ref.kind}; declare the realized reference or use approx svd"), ("rules", i, "geometry", "reference")


_SET_SHRUNK = {"frobenius_sphere", "stiefel", "sign_set", "spectral_sphere", "linf_sphere"}


@lint_rule("GO108", "decay-leaves-set", "warning")
def decay_leaves_set(ctx: LintContext):
    """Decoupled weight decay (X ← X(1 − lr·wd)) shrinks X off a sphere, Stiefel or sign set
    before every step; the backward step then starts from an infeasible point.

    Bad: ``weight_decay: 0.1`` with ``constraint: {kind: stiefel}``. Fixed: drop the decay (the set
    already bounds the weights) or use a ball.
    """
    for i, rule in enumerate(ctx.spec.rules):
        wd = rule.weight_decay if rule.weight_decay is not None else ctx.spec.defaults.weight_decay
        if wd and rule.constraint is not None and rule.constraint.kind in _SET_SHRUNK:
            yield (f"rule '{rule.name}': weight_decay={wd:g} shrinks X out of the {rule.constraint.kind} "
                   f"each step; remove it"), ("rules", i, "constraint", "kind")


@lint_rule("GO120", "inapplicable-stage", "error", needs_model=True)
def inapplicable_stage(ctx: LintContext):
    """A post-stage that cannot act on a tensor its rule owns: row or column second moments
    (``second_moment`` with ``axis: row`` or ``column``) need a matrix, and a 1-D tensor has none.

    Bad: ``match: "**"`` with ``post: [{kind: second_moment, axis: row}]`` (biases are 1-D).
    Fixed: ``axis: element``, or a rule that owns only matrices (``match: {ndim: 2}``).
    """
    for i, rule in enumerate(ctx.spec.rules):
        for j, stage in enumerate(rule.post or ()):
            if stage.kind != "second_moment" or stage.axis == "element":
                continue
            small = [p for p in ctx.owned(i) if len(p.shape) < 2]
            if small:
                names = ", ".join(f"'{p.name}' ({_shape(p)})" for p in small[:3]) + (" …" if len(small) > 3 else "")
                yield (f"rule '{rule.name}': second_moment(axis={stage.axis}) normalizes rows or columns of a matrix, "
                       f"and {len(small)} tensor(s) it owns have fewer than 2 dims: {names}; use axis: element or "
                       f"match only matrices (ndim: 2)"), ("rules", i, "post", j, "axis")


def _sign_like(rule) -> bool:
    ref = _field(rule.geometry, "reference")
    return rule.geometry.kind == "anisotropic" and ref is not None and ref.kind == "indicator"


@lint_rule("GO121", "stage-undoes-geometry", "warning")
def stage_undoes_geometry(ctx: LintContext):
    """A post-stage that undoes what the geometry did: an elementwise second moment after a sign
    geometry (every entry of sign(D) has magnitude 1, so the running mean of U² tends to 1 and the
    stage only adds lag), or after the adam geometry (the update is normalized twice).

    Bad: ``geometry: {kind: anisotropic, reference: {kind: indicator}}`` with ``post:
    [{kind: second_moment, axis: element}]``. Fixed: drop the stage, or normalize a spectral or
    Euclidean update instead.
    """
    for i, rule in enumerate(ctx.spec.rules):
        for j, stage in enumerate(rule.post or ()):
            if stage.kind == "second_moment" and stage.axis == "element" and (_sign_like(rule) or rule.geometry.kind == "adam"):
                what = "a sign geometry's entries all have magnitude 1" if _sign_like(rule) else "adam already divides by √v"
                yield (f"rule '{rule.name}': second_moment(axis=element) after the {rule.geometry.kind} geometry: {what}, "
                       f"so the stage undoes nothing useful; drop it"), ("rules", i, "post", j, "kind")


#: constraints whose backward step acts entry by entry (a masked update is still theirs to project)
_ELEMENTWISE_SETS = ("proximal_decay", "linf_ball", "sign_set")


@lint_rule("GO122", "cautious-under-constraint", "warning")
def cautious_under_constraint(ctx: LintContext):
    """Cautious masking (``post: [cautious]``) or cautious weight decay under a constraint whose
    backward step is a prox of the whole update (balls, spheres, Stiefel, rank): the prox is
    defined for the geometry's step Y = X − γρ∇φ*(D), and a masked step or a partial decay is no
    longer that, so the step leaves the method the constraint was chosen for.

    Bad: ``post: [{kind: cautious}]`` with ``constraint: {kind: spectral_ball}``. Fixed: drop the
    masking, or drop the constraint (cautious Muon is unconstrained).
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.constraint is None or rule.constraint.kind in _ELEMENTWISE_SETS:
            continue
        for j, stage in enumerate(rule.post or ()):
            if stage.kind == "cautious":
                yield (f"rule '{rule.name}': cautious masking under the {rule.constraint.kind} constraint, whose prox "
                       f"needs the full update; drop one of them"), ("rules", i, "post", j, "kind")
        decay = rule.decay if rule.decay is not None else ctx.spec.defaults.decay
        if decay is not None and decay.kind == "cautious":
            at = ("rules", i, "decay") if rule.decay is not None else ("defaults", "decay")
            yield (f"rule '{rule.name}': cautious weight decay under the {rule.constraint.kind} constraint, whose prox "
                   f"needs the full update; use decoupled decay or drop the decay"), at


@lint_rule("GO109", "outside-theory", "note")
def outside_theory(ctx: LintContext):
    """Choices the paper's convergence theory does not cover: the ``adam`` geometry (an escape hatch
    for hybrids) and any constraint with the ``indicator`` reference (lmo / Frank–Wolfe steps:
    the Fenchel–Young stationarity gap is not available).

    Example: ``geometry: {kind: adam}`` (noted; fine for embeddings in a hybrid). Inside the theory:
    ``geometry: {kind: spectral, reference: {kind: power_barrier, kappa: 4, eps: 1.0e-3}}`` with
    ``constraint: {kind: frobenius_ball}``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        g = rule.geometry
        if g.kind == "adam":
            yield f"rule '{rule.name}': the adam geometry is outside the paper's theory", ("rules", i, "geometry", "kind")
        ref = _field(g, "reference")
        if rule.constraint is not None and ref is not None and ref.kind == "indicator":
            yield (f"rule '{rule.name}': {rule.constraint.kind} with the indicator reference is outside the "
                   f"theory (no stationarity gap)"), ("rules", i, "geometry", "reference")


# ---------------------------------------------------------------- roles and views


def _roles_of(rule) -> set:
    role = rule.match.role
    return set() if role is None else {role} if isinstance(role, str) else set(role)


def _absent_role(ctx: LintContext, rule) -> bool:
    """A rule selecting by role that matches nothing because of its role (and shape) predicates:
    its name pattern, if any, names some tensor."""
    if rule.match.role is None:
        return False
    if rule.match.name is None:
        return True
    fm = glob_regex(rule.match.name).fullmatch
    return any(any_name(fm, p) for p in ctx.params)


@lint_rule("GO113", "absent-role", "note", needs_model=True)
def absent_role(ctx: LintContext):
    """A rule that selects tensors by role matches nothing because the model has no tensor with
    that role: a generic spec meets models without embeddings (a ResNet) or experts (a dense
    transformer). Information, not a problem; a name pattern that matches nothing stays a
    warning (GO102), since that is usually a typo.

    Example: ``match: {role: embedding}`` against a ResNet-18 notes "no tensor has role
    embedding".
    """
    for i, rule in enumerate(ctx.spec.rules):
        if not ctx.matched[i] and not ctx.undecided[i] and _absent_role(ctx, rule):
            roles = ", ".join(sorted(_roles_of(rule)))
            rest = describe(rule.match.model_copy(update={"role": None, "name": None})) if (
                rule.match.ndim is not None or rule.match.shape is not None or rule.match.module is not None) else ""
            yield (f"rule '{rule.name}' is idle: no tensor of this model has role {roles}"
                   + (f" with {rest}" if rest else "")), ("rules", i, "match", "role")


@lint_rule("GO114", "unused-role-pattern", "warning", needs_model=True)
def unused_role_pattern(ctx: LintContext):
    """A pattern under the spec's ``roles:`` that names no tensor: usually a misspelled name, so
    the role it meant to give is not given.

    Bad: ``roles: {head: ["clasifier.weight"]}``. Fixed: ``roles: {head: ["classifier.weight"]}``.
    """
    for role, patterns in ctx.spec.roles.items():
        for j, pattern in enumerate(patterns):
            fm = glob_regex(pattern).fullmatch
            if not any(any_name(fm, p) for p in ctx.params):
                yield f"roles: pattern {pattern!r} for role {role} names no tensor of the model", ("roles", role, j)


_SPECIAL = ("head", "embedding", "router")


@lint_rule("GO115", "special-role-spectral", "warning", needs_model=True)
def special_role_spectral(ctx: LintContext):
    """A head, embedding or router under a spectral geometry: their updates are not the spectral
    lmo's job (an embedding's rows are looked up one token at a time, a head's and a router's
    outputs are logits), and Muon/Scion practice gives them their own rule. The message gives the
    evidence for the role (``geomopt explain`` shows it too).

    Bad: ``match: {name: "**.weight", ndim: 2}`` with a spectral geometry on a BERT classifier
    (``classifier.weight`` is the head). Fixed: a rule ``match: {role: [head, router]}`` before it.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind != "spectral":
            continue
        for p in ctx.owned(i):
            special = [r for r in (p.role.roles if p.role else ()) if r in _SPECIAL]
            if special:
                guess = " (guessed from names)" if p.role.guessed else ""
                yield (f"rule '{rule.name}' gives the spectral geometry to '{p.name}' ({_shape(p)}), which has role "
                       f"{special[0]}{guess}: {p.role.evidence}; give it a rule before this one "
                       f"(match: {{role: {special[0]}}})"), ("rules", i, "match")


@lint_rule("GO116", "matrix-to-catch-all", "warning", needs_model=True)
def matrix_to_catch_all(ctx: LintContext):
    """A body tensor with ≥ 2 dims (role hidden or expert) that falls to a rule with a
    non-matrix geometry while the spec has a spectral rule: usually a pattern that missed it
    (batched expert weights (E, out, in) sent to Adam by an ``ndim: 2`` match).

    Bad: ``match: {name: "**.weight", ndim: 2}`` on a Mixtral (``experts.gate_up_proj`` is 3-D
    and falls to the catch-all). Fixed: ``match: {role: [hidden, expert]}`` with ``view: auto``.
    """
    spectral = [i for i, r in enumerate(ctx.spec.rules) if r.geometry.kind == "spectral"]
    if not spectral:
        return
    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind in ("spectral", "rowwise", "columnwise"):
            continue
        missed = [p for p in ctx.owned(i) if len(p.shape) >= 2 and p.role is not None
                  and set(p.role.roles) & {"hidden", "expert"} and not set(p.role.roles) & set(_SPECIAL)]
        if missed:
            shown = ", ".join(f"'{p.name}' ({_shape(p)}, {p.role.name})" for p in missed[:3]) + (" …" if len(missed) > 3 else "")
            yield (f"rule '{rule.name}' ({rule.geometry.kind}) takes {len(missed)} body matrix tensor(s) while rule "
                   f"'{ctx.spec.rules[spectral[0]].name}' is spectral: {shown}; match them by role "
                   f"(match: {{role: [hidden, expert]}})"), ("rules", i, "match")


@lint_rule("GO117", "merged-matrices", "warning", needs_model=True)
def merged_matrices(ctx: LintContext):
    """A matrix geometry whose view merges matrices the model keeps separate: batched expert
    weights (E, out, in) read as one E × out·in matrix orthogonalize the experts together (each
    expert's slice then has singular values far from 1).

    Bad: ``geometry: {kind: spectral, …}`` (no view) on Mixtral's ``experts.gate_up_proj``.
    Fixed: ``view: auto`` (or ``view: {kind: matrix, batch: 1}``).
    """
    from geomopt.compile.plan import resolve_view

    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind not in ("spectral", "rowwise", "columnwise"):
            continue
        geometry = rule.geometry.model_dump()
        for p in ctx.owned(i):
            structure = p.role.structure if p.role is not None else None
            if not structure or not structure.get("batch") or len(p.shape) < 3:
                continue
            op_geometry, _, op_shape = op_layout(geometry, p)
            try:
                view = resolve_view(op_geometry, op_shape, structure).get("view")
            except ValueError:
                continue  # GO104's finding
            if view is None or view["batch"] < structure["batch"]:
                yield (f"rule '{rule.name}' reads '{p.name}' ({_shape(p)}) as one matrix, but it holds "
                       f"{p.shape[0]} experts ({p.role.evidence}); add view: auto"), ("rules", i, "geometry", "kind")


@lint_rule("GO118", "guessed-roles", "note", needs_model=True)
def guessed_roles(ctx: LintContext):
    """Roles read from names and shapes only (a checkpoint, or a list of (name, tensor)) are
    guesses: lint against the model (``--model``) to infer them from its structure, or pin them
    with the spec's ``roles:``.

    Example: ``geomopt lint specs/muon.yaml --checkpoint model.safetensors`` notes how many roles
    were guessed and shows a few.
    """
    if not any(r.match.role is not None for r in ctx.spec.rules) and not ctx.spec.roles:
        return
    guessed = [p for p in ctx.params if p.role is not None and p.role.guessed]
    if guessed:
        shown = ", ".join(f"'{p.name}' → {p.role.name}" for p in guessed[:4]) + (" …" if len(guessed) > 4 else "")
        yield (f"{len(guessed)} role(s) guessed from names and shapes (no model): {shown}; lint with --model to "
               f"infer them from the model's structure"), ("rules",)


@lint_rule("GO119", "ambiguous-role", "note", needs_model=True)
def ambiguous_role(ctx: LintContext):
    """An inference with two candidates, e.g. two last layers reading the same features (two
    heads): both get the role, never one silently; pin the intended one with the spec's
    ``roles:`` if that is wrong.

    Example: a model ending in ``head_a = Linear(64, 10)`` and ``head_b = Linear(64, 5)``: both are
    heads, and lint names both.
    """
    both = [p.name for p in ctx.params if p.role is not None and "one of two last layers" in p.role.evidence]
    if both:
        yield f"two candidate heads, both given role head: {', '.join(repr(n) for n in both)}", ("rules",)


def rule_doc(code: str) -> Optional[str]:
    """The text ``geomopt rule CODE`` prints (language codes included)."""
    code = code.upper()
    if code in RULES:
        r = RULES[code]
        return f"{r.code} {r.name} ({r.severity})\n\n{r.doc}\n"
    if code in LANGUAGE_CODES:
        name, doc = LANGUAGE_CODES[code]
        return f"{code} {name} (error)\n\n{doc[0].upper() + doc[1:]}.\n"
    return None


__all__ = ["RULES", "LintContext", "LintRule", "lint_rule", "rule_doc", "run_rules"]
