"""The public entry point, :func:`lint_spec`: build a :class:`~geomopt.lint.context.LintContext`,
run the selected rules, apply the spec's suppression comments (:mod:`geomopt.lint.suppress`) and
sort the findings by position.

Selection (``select=``, ``ignore=``; ``geomopt lint --select … --ignore …``) works as ruff's: a
selector is a code (``GO107``), a prefix of codes (``GO1`` is every lint rule, ``GO10`` is
GO100–GO109), a rule's name (``reference-approx-mismatch``) or ``ALL``; each is a comma-separated
string or a list of them. A rule runs when some ``select`` selector matches it (no ``select``:
all rules) and no ``ignore`` selector matches it at least as specifically (the longer prefix
wins; a name counts as its full code, ``ALL`` as the empty prefix; on a tie ``ignore`` wins), so
``select="GO1", ignore="GO109"`` runs every rule but GO109 and ``select="GO107", ignore="GO1"``
runs GO107. A selector that matches no lint rule is an error (:class:`ValueError`). Selection
applies to lint findings: parse and schema errors (GO0xx) are always reported, and compile
refuses a spec with blocking errors whatever lint was asked to show.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Union

from geomopt.compile.match import ParamInfo
from geomopt.lint.context import RULES, LintContext, rule_by_name, run_rules, runs
from geomopt.lint.suppress import apply, directives, source_text
from geomopt.spec.diagnostics import LANGUAGE_CODES, Diagnostic, did_you_mean
from geomopt.spec.model import Spec
from geomopt.spec.validate import source_of

Selectors = Union[str, Iterable[str], None]


def lint_spec(spec: Spec, params: list[ParamInfo] | None = None, *, from_checkpoint: bool = False,
              select: Selectors = None, ignore: Selectors = None, text: str | None = None) -> list[Diagnostic]:
    """Every lint finding of ``spec`` against ``params`` (None: the spec alone), sorted by position.

    ``select``, ``ignore``: which rules run (module docstring). ``text``: the spec's source text,
    whose ``# geomopt: disable=…`` comments silence findings; None reads the file the spec was
    loaded from, where there is one (a spec parsed from a string has none: pass its text)."""
    codes = selected_codes(select, ignore)
    ctx = LintContext.build(spec, params, from_checkpoint)
    source = source_of(spec)
    found = run_rules(ctx, source, codes)
    if text is None:
        text = source_text(source)
    if text:
        marks = directives(text, source.format if source is not None else "yaml")
        if marks:
            ran = {code for code, rule in RULES.items() if runs(rule, ctx, codes)}
            found = apply(found, marks, ran=ran, file=source.file if source is not None else "<spec>")
    return sorted(found, key=lambda d: (d.line, d.col, d.code))


def selected_codes(select: Selectors = None, ignore: Selectors = None) -> frozenset | None:
    """The codes of the rules that run for ``select`` and ``ignore`` (None: every rule); raises
    :class:`ValueError` for a selector that matches no lint rule."""
    if select is None and ignore is None:
        return None
    chosen = _selectors(select) if select is not None else [("", 0)]
    dropped = _selectors(ignore) if ignore is not None else []
    out = set()
    for code in RULES:
        s = max((n for prefix, n in chosen if code.startswith(prefix)), default=None)
        i = max((n for prefix, n in dropped if code.startswith(prefix)), default=None)
        if s is not None and (i is None or s > i):
            out.add(code)
    return frozenset(out)


def split_selectors(value: Selectors) -> list[str]:
    """``"GO1, GO107"`` or ``["GO1", "GO107,GO109"]`` → the selectors, in order."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [t.strip() for item in items for t in str(item).split(",") if t.strip()]


def _selectors(value: Selectors) -> list[tuple[str, int]]:
    """(code prefix, specificity) per selector."""
    out = []
    for token in split_selectors(value):
        if token.upper() == "ALL":
            out.append(("", 0))
            continue
        code = rule_by_name(token.lower())
        if code is not None:
            out.append((code, len(code)))
            continue
        prefix = token.upper()
        if re.fullmatch(r"GO\d{0,3}", prefix) and any(c.startswith(prefix) for c in RULES):
            out.append((prefix, len(prefix)))
            continue
        if re.fullmatch(r"GO\d{0,3}", prefix) and any(c.startswith(prefix) for c in LANGUAGE_CODES):
            raise ValueError(f"rule selector {token!r} names parse and schema errors (GO0xx), which are always "
                             "reported; select lint rules (GO1xx)")
        hint = did_you_mean(token, [*RULES, *(r.name for r in RULES.values())])
        raise ValueError(f"unknown rule selector {token!r}{hint}: give a code (GO107), a prefix of codes (GO1, GO10), "
                         "a rule's name (reference-approx-mismatch) or ALL; `geomopt rule` lists them")
    return out


__all__ = ["lint_spec", "selected_codes", "split_selectors"]
