"""The lint machinery the rule families share: the rule registry (:data:`RULES`), the
:func:`lint_rule` decorator, the :class:`LintContext` a rule reads, and :func:`run_rules`.

A rule is ``fn(ctx) -> iterable of (message, path)``; ``path`` locates the finding in the spec
source (``("rules", 2, "constraint")``). Rules never raise for a bad spec: they report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from geomopt.compile.match import ParamInfo
from geomopt.compile.ownership import Ownership
from geomopt.registry import Registry
from geomopt.spec.diagnostics import LANGUAGE_CODES, Diagnostic
from geomopt.spec.model import Spec
from geomopt.spec.source import SourceMap


@dataclasses.dataclass(frozen=True)
class LintRule:
    """One registered rule: what ``geomopt rule CODE`` prints and what :func:`run_rules` calls."""

    code: str
    name: str
    severity: str
    fn: Callable
    needs_model: bool = False

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()


#: code → :class:`LintRule`; ``RULES.meta[code]`` holds code, name, severity and needs_model
RULES: Registry = Registry("lint rule")


def lint_rule(code: str, name: str, severity: str, *, needs_model: bool = False):
    """Register ``fn`` under ``code``; ``needs_model`` rules run only when linting against a model
    or a checkpoint. A code registered twice is an error."""

    def register(fn):
        meta = {"code": code, "name": name, "severity": severity, "needs_model": needs_model}
        RULES.register(code, **meta)(LintRule(fn=fn, **meta))
        return fn

    return register


def rule_by_name(name: str) -> str | None:
    """The code of the rule called ``name`` (kebab-case), or None."""
    for code, rule in RULES.items():
        if rule.name == name:
            return code
    return None


@dataclasses.dataclass
class LintContext(Ownership):
    """What a rule reads: the spec's :class:`~geomopt.compile.ownership.Ownership` of the tensors,
    and how they came (``has_model`` False: the spec alone)."""

    from_checkpoint: bool = False
    has_model: bool = True

    @classmethod
    def build(cls, spec: Spec, params: list[ParamInfo] | None, from_checkpoint: bool = False) -> LintContext:
        """``params`` None: lint the spec alone (rules that need a model are skipped)."""
        return cls.match(spec, params or [], from_checkpoint=from_checkpoint, has_model=params is not None)


def runs(rule: LintRule, ctx: LintContext, codes: Iterable[str] | None = None) -> bool:
    """Whether :func:`run_rules` runs ``rule`` for ``ctx`` (``codes``: the selected codes)."""
    return (codes is None or rule.code in codes) and (ctx.has_model or not rule.needs_model)


def run_rules(ctx: LintContext, source: SourceMap | None, codes: Iterable[str] | None = None) -> list[Diagnostic]:
    """The findings of every registered rule (of those in ``codes``, when given), unsorted."""
    wanted = set(codes) if codes is not None else None
    file = source.file if source else "<spec>"
    out = []
    for code, rule in RULES.items():
        if not runs(rule, ctx, wanted):
            continue
        for message, path in rule.fn(ctx):
            line, col = source.pos(path) if source else (1, 1)
            out.append(Diagnostic(code, rule.name, rule.severity, message, file, line, col))
    return out


def rule_doc(code: str) -> str | None:
    """The text ``geomopt rule CODE`` prints (language codes included)."""
    code = code.upper()
    if code in RULES:
        r = RULES[code]
        return f"{r.code} {r.name} ({r.severity})\n\n{r.doc}\n"
    if code in LANGUAGE_CODES:
        name, doc = LANGUAGE_CODES[code]
        return f"{code} {name} (error)\n\n{doc[0].upper() + doc[1:]}.\n"
    return None


# ---------------------------------------------------------------- helpers of several families


__all__ = ["RULES", "LintContext", "LintRule", "lint_rule", "rule_by_name", "rule_doc", "run_rules", "runs"]
