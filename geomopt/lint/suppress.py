"""Suppression comments: silence a finding where it is written, as ``# noqa`` does for ruff.

Both spellings comment with ``#``, and a spec's comments are found as ``geomopt fmt`` finds them
(:func:`geomopt.spec.comments.scan_yaml`, :func:`~geomopt.spec.comments.scan_dsl`: a ``#``
inside a string is text). A comment holding

* ``# geomopt: disable=GO107`` silences GO107 for the line it ends, or, standing on its own
  line, for the next line that is not a comment (put it directly above the finding's line);
* ``# geomopt: disable-file=GO109`` silences GO109 anywhere in the file.

Several codes are comma-separated (``disable=GO107,GO109``); a rule's name works as its code
(``disable=reference-approx-mismatch``). Text after the codes is free, e.g. a reason:
``# geomopt: disable=GO107 -- the heuristic is this mismatch``. A finding's line is where
``geomopt lint`` points (``file:LINE:col``).

Blocking errors (:data:`geomopt.compile.blocking.BLOCKING`: compile refuses the spec) cannot be
silenced: they are still reported, their message says the suppression does not apply, and the
suppression itself is reported. GO123 (a note at the comment) reports a suppression that silences
nothing: a code that did not fire there, an unknown code, a blocking or a language (GO0xx) code.
A code whose rule did not run (not selected, or a rule that needs a model when linting the spec
alone) is not called unused. GO123 can itself be silenced (``disable-file=GO123``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from geomopt.compile.blocking import BLOCKING
from geomopt.lint.context import RULES, lint_rule, rule_by_name
from geomopt.spec.diagnostics import LANGUAGE_CODES, Diagnostic, did_you_mean
from geomopt.spec.source import MAX_BYTES, SourceMap
from geomopt.spec.comments import scan_dsl, scan_yaml

UNUSED = "GO123"
#: the cheap test that spares scanning the comments of a file without suppressions
QUICK = re.compile(r"geomopt\s*:\s*disable", re.IGNORECASE)
DIRECTIVE = re.compile(r"#\s*geomopt\s*:\s*disable(?P<file>-file)?(?![\w-])"
                       r"(?:\s*=\s*(?P<codes>[\w-]+(?:[ \t]*,[ \t]*[\w-]+)*))?",
                       re.IGNORECASE)


@lint_rule(UNUSED, "unused-suppression", "note")
def unused_suppression(ctx):
    """A suppression comment (``# geomopt: disable=CODE``) that silences nothing: the code does
    not fire on that line (or, for ``disable-file``, in the file), the code is unknown, or it names
    a blocking error (GO101, GO104, GO105, GO120, GO126, GO127: compile refuses the spec, so they cannot be
    silenced) or a parse error (GO0xx). Reported at the comment, so stale suppressions do not pile up.

    Bad: ``geometry: {kind: euclidean}  # geomopt: disable=GO109`` (the euclidean geometry is
    inside the theory: GO109 never fires there). Fixed: remove the comment. A suppression that
    works: ``geometry: {kind: adam}  # geomopt: disable=GO109 -- the hybrid's embeddings``.
    """
    return ()  # the findings come from :func:`apply`, which sees the comments and the other findings


@dataclasses.dataclass
class Directive:
    """One ``# geomopt: disable…`` comment: where its ``#`` is, the line it silences (0: the
    whole file) and its codes as written."""

    line: int
    col: int
    target: int
    codes: list[str]

    @property
    def where(self) -> str:
        return "in this file" if self.target == 0 else f"on line {self.target}"


def directives(text: str, format: str = "yaml") -> list[Directive]:
    """The suppression comments of spec ``text`` (``format`` "yaml" or "dsl")."""
    if not QUICK.search(text):
        return []

    try:
        found = scan_dsl(text) if format == "dsl" else scan_yaml(text)
    except yaml.YAMLError:  # PyYAML's scanner refuses what libyaml read: approximate
        found = scan_dsl(text)
    comment_lines = {c.line for c in found if c.own_line}
    out = []
    for c in found:
        for m in DIRECTIVE.finditer(c.text):
            if m.group("file"):
                target = 0
            elif c.own_line:
                target = c.line + 1
                while target in comment_lines:
                    target += 1
            else:
                target = c.line
            codes = [t.strip() for t in m.group("codes").split(",")] if m.group("codes") else []
            out.append(Directive(c.line, c.col + m.start(), target, codes))
    return out


def code_of(token: str) -> str | None:
    """The code a suppression token names (a code in any case, or a rule's name), or None."""
    upper = token.upper()
    if upper in RULES or upper in LANGUAGE_CODES:
        return upper
    return rule_by_name(token.lower())


def apply(findings: Iterable[Diagnostic], found: list[Directive], *, ran: set, file: str) -> list[Diagnostic]:
    """``findings`` less those the directives ``found`` silence, plus GO123 for each directive
    code that silences nothing (when GO123 is in ``ran``: the codes whose rules ran)."""
    by_line: dict[int, list] = {}
    for k, d in enumerate(found):
        for t, token in enumerate(d.codes):
            by_line.setdefault(d.target, []).append((k, t, code_of(token)))
    used: set = set()
    out = []
    for f in findings:
        hits = [(k, t) for k, t, code in by_line.get(f.line, []) + by_line.get(0, []) if code == f.code]
        if not hits:
            out.append(f)
        elif f.code in BLOCKING:
            d = found[hits[0][0]]
            out.append(dataclasses.replace(f, message=f"{f.message} (not suppressed: a blocking error; the "
                                                      f"suppression at {d.line}:{d.col} does not apply)"))
        else:
            used.update(hits)
    if UNUSED not in ran:
        return out
    reports = []
    for k, d in enumerate(found):
        if not d.codes:
            reports.append(_report(d, file, "suppression names no code: write `# geomopt: disable=CODE[,CODE…]`"))
        seen = set()
        for t, token in enumerate(d.codes):
            code = code_of(token)
            if code in seen or code == UNUSED:
                continue
            seen.add(code)
            if code is None:
                choices = [*RULES, *(r.name for r in RULES.values())]
                reports.append(_report(d, file, f"unknown code {token!r} in suppression{did_you_mean(token, choices)}; "
                                                "`geomopt rule` lists the codes"))
            elif code in LANGUAGE_CODES:
                reports.append(_report(d, file, f"{code} ({LANGUAGE_CODES[code][0]}) is a parse or schema error: "
                                                "a spec that has one is not linted, and it cannot be suppressed"))
            elif code in BLOCKING:
                reports.append(_report(d, file, f"unusable suppression: {code} ({RULES[code].name}) is a blocking "
                                                "error (compile refuses the spec) and cannot be suppressed; fix it"))
            elif code in ran and (k, t) not in used:
                reports.append(_report(d, file, f"unused suppression: {code} ({RULES[code].name}) reports nothing "
                                                f"{d.where}; remove it"))
    silenced = {d.target for d in found for token in d.codes if code_of(token) == UNUSED}
    return out + [r for r in reports if r.line not in silenced and 0 not in silenced]


def _report(d: Directive, file: str, message: str) -> Diagnostic:
    rule = RULES[UNUSED]
    return Diagnostic(UNUSED, rule.name, rule.severity, message, file, d.line, d.col)


def source_text(source: SourceMap | None) -> str | None:
    """The text of the file a spec was read from (suppressions live there), or None where there
    is none (a spec given as text, a dict, or built in Python) or it cannot be read."""
    if source is None or not source.file or source.file.startswith("<"):
        return None
    path = Path(source.file)
    try:
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            return None
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return None


__all__ = ["DIRECTIVE", "UNUSED", "Directive", "apply", "code_of", "directives", "source_text"]
