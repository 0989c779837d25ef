"""Model coverage: does every tensor get exactly the rule the author meant? GO101 unmatched
parameter, GO102 unused rule, GO103 shadowed rule, and the notes GO110 frozen parameters, GO111
tied parameters, GO112 undecidable module predicates. All need a model or a checkpoint.
"""

from __future__ import annotations

from geomopt.compile.blocking import BLOCKING
from geomopt.compile.match import describe
from geomopt.lint.context import LintContext, lint_rule
from geomopt.lint.roles import role_is_absent


# GO101 is blocking: its check lives with the compiler's (geomopt.compile.blocking)
lint_rule("GO101", severity="error", **BLOCKING.meta["GO101"])(BLOCKING["GO101"])


class UnusedRuleWarning(UserWarning):
    """Warned by :class:`~geomopt.optim.GeomOptimizer` when it is built, once per rule that GO102
    finds (a rule matching no tensor of the model): lint reports it only when someone runs lint, and
    an idle rule (a typo in a pattern, a tensor renamed) otherwise trains the model under another
    rule without a word. A rule idle only because the model has no tensor of its role (GO113) is
    not warned about: that is what a generic spec meets on most models."""


@lint_rule("GO102", "unused-rule", "warning", needs_model=True)
def unused_rule(ctx: LintContext):
    """A rule that matches no parameter of the model: usually a misspelled pattern.
    ``GeomOptimizer`` warns of it too (:class:`UnusedRuleWarning`), with this code.

    Bad: ``match: "transformer.h.*.attn.weight"`` on a model whose weights are
    ``transformer.h.0.attn.c_attn.weight``. Fixed: ``match: "transformer.h.*.attn.*.weight"``.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if not ctx.matched[i] and not ctx.undecided[i] and not role_is_absent(ctx, rule):
            yield f"rule '{rule.name}' ({describe(rule.match)}) matches no parameter", ("rules", i, "match")


@lint_rule("GO103", "shadowed-rule", "warning", needs_model=True)
def shadowed_rule(ctx: LintContext):
    """A rule whose every match is already owned by earlier rules (the first match wins), below a
    rule broader than it: one of those earlier rules also matches tensors it does not, so the
    author most likely meant it to take its tensors first. A fallback is not shadowed: a rule
    matching every tensor its shadowing rules match (a catch-all ``**`` after rules that happen to
    claim the whole model, e.g. a LoRA model whose only trainable tensors are the adapters'
    matrices) would take their tensors if moved up, so it is only idle here; a rule with the same
    ``match`` as an earlier one is reported. Not reported either for a role rule whose only
    matches are tied tensors with several roles (GPT-2's ``wte`` = ``lm_head`` is an embedding and
    a head: the embedding rule owns it, GO111 says so).

    Bad: a catch-all ``match: "**"`` before ``match: "*.bias"``. Fixed: put specific rules first.
    """
    roles = {p.name: p.role for p in ctx.params}
    for i, rule in enumerate(ctx.spec.rules):
        if rule.match.role is not None and all((r := roles.get(n)) is not None and len(r.roles) > 1
                                               for n in ctx.matched[i]):
            continue
        earlier_owners = [o for n in ctx.matched[i] if (o := ctx.owner[n]) is not None and o < i]
        if not ctx.matched[i] or len(earlier_owners) != len(ctx.matched[i]):
            continue
        mine = set(ctx.matched[i])
        if all(mine.issuperset(ctx.matched[o]) and ctx.spec.rules[o].match != rule.match for o in set(earlier_owners)):
            continue  # a fallback behind narrower rules: moving it up would take their tensors
        earlier = sorted({ctx.spec.rules[o].name for o in earlier_owners})
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
        yield (f"{len(names)} frozen parameter(s) skipped: {', '.join(names[:5])}" + (" …" if len(names) > 5 else ""),
               ("rules",))


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
            yield (f"'{p.name}' is tied to {', '.join(repr(a) for a in p.aliases)}: planned once, by its first name",
                   ("rules",))


@lint_rule("GO112", "undecidable-module", "note", needs_model=True)
def undecidable_module(ctx: LintContext):
    """A ``module:`` predicate linted against a checkpoint.

    A checkpoint stores names and shapes, not module types, so lint cannot tell which tensors the rule takes: lint
    against the model (``--model``) to check it.

    Example: ``match: {module: Embedding}`` linted with ``--checkpoint model.safetensors`` notes
    the rule; ``--model pkg.module:factory`` decides it, or match by name instead
    (``match: "transformer.wt?.weight"``). ``geomopt plan`` refuses tensors that only such a rule
    could match.
    """
    for i, rule in enumerate(ctx.spec.rules):
        if ctx.undecided[i]:
            yield (f"rule '{rule.name}' tests module={rule.match.module}, unknown for {len(ctx.undecided[i])} "
                   f"checkpoint tensor(s); lint with --model to check it"), ("rules", i, "match", "module")
