"""Roles and views: does the spec treat each kind of tensor (embedding, head, router, expert,
hidden, …; :mod:`geomopt.compile.roles`) as its role asks? GO113 a role rule idle for this model
(a note), GO114 a ``roles:`` pattern naming no tensor, GO115 a head, embedding or router under a
spectral geometry, GO116 a body matrix falling to a non-matrix catch-all, GO117 batched expert
weights read as one matrix, and the notes GO118 guessed roles, GO119 an ambiguous head, GO124 roles
decided without a trace, GO125 traced roles that differ from the module tree's. All need a model or
a checkpoint.
"""

from __future__ import annotations

import math

from geomopt.compile.match import any_name, describe, glob_regex, shape_text
from geomopt.compile.resolve import op_layout, resolve_view
from geomopt.lint.context import LintContext, lint_rule
from geomopt.support import MATRIX_GEOMETRIES


def _roles_of(rule) -> set:
    role = rule.match.role
    return set() if role is None else {role} if isinstance(role, str) else set(role)


def role_is_absent(ctx: LintContext, rule) -> bool:
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
        if not ctx.matched[i] and not ctx.undecided[i] and role_is_absent(ctx, rule):
            roles = ", ".join(sorted(_roles_of(rule)))
            rest = describe(rule.match.model_copy(update={"role": None, "name": None})) if (
                rule.match.ndim is not None or rule.match.shape is not None or rule.match.module is not None) else ""
            yield (f"rule '{rule.name}' is idle: no tensor of this model has role {roles}"
                   + (f" with {rest}" if rest else "")), ("rules", i, "match", "role")


@lint_rule("GO114", "unused-role-pattern", "warning", needs_model=True)
def unused_role_pattern(ctx: LintContext):
    """A pattern under the spec's ``roles:`` that names no tensor.

    It is usually a misspelled name, so the role it meant to give is not given.

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
            if p.role is None:
                continue
            special = [r for r in p.role.roles if r in _SPECIAL]
            if special:
                guess = " (guessed from names)" if p.role.guessed else ""
                yield (f"rule '{rule.name}' gives the spectral geometry to '{p.name}' ({shape_text(p)}), "
                       f"which has role {special[0]}{guess}: {p.role.evidence}; give it a rule before this one "
                       f"(match: {{role: {special[0]}}})"), ("rules", i, "match")


@lint_rule("GO116", "matrix-to-catch-all", "warning", needs_model=True)
def matrix_to_catch_all(ctx: LintContext):
    """A body tensor with ≥ 2 dims (role hidden or expert) that falls to a rule with a non-matrix geometry while the
    spec has a spectral rule.

    It is usually a pattern that missed it: batched expert weights (E, out, in) sent to Adam by an ``ndim: 2``
    match, while the other matrices of the body take the spectral step.

    Bad: ``match: {name: "**.weight", ndim: 2}`` on a Mixtral (``experts.gate_up_proj`` is 3-D
    and falls to the catch-all). Fixed: ``match: {role: [hidden, expert]}`` with ``view: auto``.
    """
    spectral = [i for i, r in enumerate(ctx.spec.rules) if r.geometry.kind == "spectral"]
    if not spectral:
        return
    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind in MATRIX_GEOMETRIES:
            continue
        missed = [(p, p.role) for p in ctx.owned(i) if len(p.shape) >= 2 and p.role is not None
                  and set(p.role.roles) & {"hidden", "expert"} and not set(p.role.roles) & set(_SPECIAL)]
        if missed:
            shown = (", ".join(f"'{p.name}' ({shape_text(p)}, {role.name})" for p, role in missed[:3])
                     + (" …" if len(missed) > 3 else ""))
            yield (f"rule '{rule.name}' ({rule.geometry.kind}) takes {len(missed)} body matrix tensor(s) while rule "
                   f"'{ctx.spec.rules[spectral[0]].name}' is spectral: {shown}; match them by role "
                   f"(match: {{role: [hidden, expert]}})"), ("rules", i, "match")


@lint_rule("GO117", "merged-matrices", "warning", needs_model=True)
def merged_matrices(ctx: LintContext):
    """A matrix geometry whose view merges matrices the model keeps separate.

    Batched expert weights (E, out, in) read as one E × out·in matrix orthogonalize the experts together: each
    expert's slice then has singular values far from 1. Under the kronecker geometry (Shampoo, SOAP, PSGD-Kron)
    the experts share one pair of factors, E × E and out·in × out·in, of the flattened shape, not each expert its
    own out × out and in × in.

    Bad: ``geometry: {kind: spectral, …}`` (no view) on Mixtral's ``experts.gate_up_proj``.
    Fixed: ``view: auto`` (or ``view: {kind: matrix, batch: 1}``).
    """
    for i, rule in enumerate(ctx.spec.rules):
        if rule.geometry.kind not in MATRIX_GEOMETRIES:
            continue
        geometry = rule.geometry
        for p in ctx.owned(i):
            if p.role is None:
                continue
            structure = p.role.structure
            if not structure or not structure.get("batch") or len(p.shape) < 3:
                continue
            op_geometry, _, op_shape = op_layout(geometry, p)
            try:
                view = resolve_view(op_geometry, op_shape, structure)
            except ValueError:
                continue  # GO104's finding
            if view is None or view["batch"] < structure["batch"]:
                shared = (f", one pair of Kronecker factors of the flattened {op_shape[0]} × "
                          f"{math.prod(op_shape[1:])} for all of them" if rule.geometry.kind == "kronecker" else "")
                message = (f"rule '{rule.name}' reads '{p.name}' ({shape_text(p)}) as one matrix, but it holds "
                           f"{p.shape[0]} experts ({p.role.evidence}){shared}; add view: auto")
                yield message, ("rules", i, "geometry", "kind")


@lint_rule("GO118", "guessed-roles", "note", needs_model=True)
def guessed_roles(ctx: LintContext):
    """Roles read from names and shapes only (a checkpoint, or a list of (name, tensor)).

    They are guesses: lint against the model (``--model``) to infer them from its structure, or pin them with the
    spec's ``roles:``.

    Example: ``geomopt lint muon --checkpoint model.safetensors`` notes how many roles
    were guessed and shows a few.
    """
    if not any(r.match.role is not None for r in ctx.spec.rules) and not ctx.spec.roles:
        return
    guessed = [(p, p.role) for p in ctx.params if p.role is not None and p.role.guessed]
    if guessed:
        shown = ", ".join(f"'{p.name}' → {role.name}" for p, role in guessed[:4]) + (" …" if len(guessed) > 4 else "")
        yield (f"{len(guessed)} role(s) guessed from names and shapes (no model): {shown}; lint with --model to "
               f"infer them from the model's structure"), ("rules",)


@lint_rule("GO119", "ambiguous-role", "note", needs_model=True)
def ambiguous_role(ctx: LintContext):
    """An inference with two candidates, e.g. two last layers reading the same features (two heads).

    Both get the role, never one silently, and lint names both so that a wrong guess is seen: pin the intended one
    with the spec's ``roles:`` if that is wrong.

    Example: a model ending in ``head_a = Linear(64, 10)`` and ``head_b = Linear(64, 5)``: both are
    heads, and lint names both.
    """
    both = [p.name for p in ctx.params if p.role is not None and "one of two last layers" in p.role.evidence]
    if both:
        yield f"two candidate heads, both given role head: {', '.join(repr(n) for n in both)}", ("rules",)


def _examples(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (" …" if len(items) > n else "")


class RolesGuessedWarning(UserWarning):
    """Warned once by :class:`~geomopt.optim.GeomOptimizer` when it is built on roles that no
    trace decided (GO124's finding, and roles guessed from names and shapes): the module tree
    cannot tell a lookup table held as a bare ``nn.Parameter`` from a hidden matrix, so a spec
    routing by role may orthogonalize it. The message gives the reason and the fix: pass
    ``example_inputs=`` (one forward's inputs), or pin the roles with the spec's ``roles:``
    (``roles=`` in Python)."""


_GUESSED = "guessed from names and shapes (no model to trace: pass the model, or model= beside its parameters)"


def untraced(params, guessed: bool = False) -> dict[str, list[str]]:
    """Why each role no trace decided was decided otherwise → ["'name' → role", …]: the module
    tree's roles with the reason there was no trace, and (``guessed``) roles guessed from names and
    shapes. Roles the spec's ``roles:`` or ``roles=`` pinned are not among them, nor zero-size
    tensors (they never step; a forward never reads them)."""
    out: dict[str, list[str]] = {}
    for p in params:
        role = p.role
        if role is None or 0 in p.shape:
            continue
        reason = role.untraced or (_GUESSED if guessed and role.guessed else None)
        if reason:
            out.setdefault(reason, []).append(f"'{p.name}' → {role.name}")
    return out


def untraced_text(by_reason: dict[str, list[str]]) -> str:
    """One sentence for :func:`untraced`'s result: how many roles, why, examples."""
    count = sum(map(len, by_reason.values()))
    why = "; ".join(f"{reason} ({'' if len(by_reason) == 1 else f'{len(names)}: '}e.g. {_examples(names, 2)})"
                    for reason, names in by_reason.items())
    return f"roles of {count} tensor(s) decided without a trace: {why}"


@lint_rule("GO124", "untraced-roles", "note", needs_model=True)
def untraced_roles(ctx: LintContext):
    """Roles decided without a trace of the forward pass: no example inputs, a forward that failed
    on the meta device and on the model's own, sharded parameters, or tensors the traced forward
    never reached. Those roles come from the module tree (class names, registration order), which
    models nobody here wrote can defeat; the note names the reason so it can be fixed.

    Example: ``geomopt lint muon --model mypkg.models:make`` where ``make`` returns a bare module
    notes "roles of 62 tensors decided without a trace: no example inputs …"; returning
    ``(model, torch.zeros(2, 3, 64, 64))`` from the factory traces it. ``GeomOptimizer`` warns of
    it too (:class:`RolesGuessedWarning`); ``geomopt lint --require-trace`` makes it fail (exit 1).
    """
    if not any(r.match.role is not None for r in ctx.spec.rules) and not ctx.spec.roles:
        return
    for reason, names in untraced(ctx.params).items():
        yield (f"roles of {len(names)} tensor(s) decided from the module tree, without a trace: {reason}; "
               f"e.g. {_examples(names)}"), ("rules",)


@lint_rule("GO125", "traced-role-differs", "note", needs_model=True)
def traced_role_differs(ctx: LintContext):
    """The traced forward gave a tensor another role than the module tree would: what the tensor
    does (a matrix operand, a lookup, elementwise only, a grouped convolution, the layer producing
    an output) decides, and this note lists what changed so nothing moves silently.
    ``geomopt explain`` shows both verdicts and the op that decided.

    Example: Mamba's ``mixer.A_log`` (64×8, used through ``exp``) was ``hidden`` by the module tree;
    traced, it is used only elementwise: ``other``.
    """
    if not any(r.match.role is not None for r in ctx.spec.rules) and not ctx.spec.roles:
        return
    changed = [f"'{p.name}' {p.role.inferred.partition(':')[0]} → {p.role.name}" for p in ctx.params
               if p.role is not None and p.role.inferred]
    if changed:
        yield (f"{len(changed)} role(s) from the traced forward differ from the module tree's: "
               f"{_examples(changed, 4)} (geomopt explain shows why)"), ("rules",)
