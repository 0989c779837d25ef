"""Diagnostics as data: one dataclass for parse errors, schema errors and lint findings.

Every problem the language or the linter finds becomes a :class:`Diagnostic`; reporters (text,
json, github) and :class:`SpecError` only ever see these.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Iterable, Literal

Severity = Literal["error", "warning", "note"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "note": 2}


@dataclasses.dataclass(frozen=True)
class Diagnostic:
    """One finding: ``file:line:col: severity CODE message`` (line and col are 1-based)."""

    code: str
    name: str
    severity: Severity
    message: str
    file: str = "<spec>"
    line: int = 1
    col: int = 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.severity} {self.code} {self.message}"

    def __str__(self) -> str:
        return self.format()


class SpecError(ValueError):
    """A spec (or a spec against a model) is invalid; ``.diagnostics`` says where and why."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = list(diagnostics)
        lines = [d.format() for d in self.diagnostics] or ["invalid spec"]
        super().__init__("\n".join(lines))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


# Codes of the language itself (parse and schema); lint rules register theirs in geomopt.lint.
LANGUAGE_CODES: dict[str, tuple[str, str]] = {
    "GO001": ("syntax-error", "the file is not valid YAML / DSL"),
    "GO002": ("duplicate-key", "a key given twice in one mapping (YAML would silently keep the last)"),
    "GO003": ("unknown-field", "a field the spec language does not have"),
    "GO004": ("unknown-kind", "a `kind` that is not registered"),
    "GO005": ("invalid-value", "a value of the wrong type or out of range"),
    "GO006": ("missing-field", "a required field is absent"),
    "GO007": ("bad-pattern", "a name pattern that does not compile, or asks what the linear-time matcher (RE2) "
              "lacks: backreferences, lookaround, repeats over 1000"),
    "GO008": ("unsupported-version", "`geomopt:` names a language version this release does not read"),
    "GO009": ("empty-spec", "the file holds no spec"),
    "GO010": ("unreadable-input", "the input is not a readable text spec (missing, not a regular file, binary, too "
              "large, an integer of thousands of digits)"),
    # spec inheritance (geomopt.spec.extends)
    "GO011": ("unknown-base", "`extends` names neither a shipped spec nor a spec file (the message lists the "
              "shipped names): write a shipped name (muon, scion, …) or a path to a .yaml, .yml or .geom file, "
              "relative to the extending file"),
    "GO012": ("inheritance-cycle", "a spec extends itself, directly or through its bases: remove one `extends` of "
              "the chain the message names (a chain of more than 256 bases is refused too)"),
    "GO013": ("bad-override", "`before`, `after` or `remove` on a rule that does not fit the base: naming a rule the "
              "base lacks, both `before` and `after`, placing an override (it keeps its base rule's place), a removed "
              "rule with other fields, or any of them in a spec without `extends`"),
    "GO014": ("invalid-extends", "`extends` is not a string: give a shipped spec's name (`extends: muon`) or a "
              "path (`extends: ../base.yaml`)"),
}


def language_diagnostic(code: str, message: str, file: str = "<spec>", pos: tuple[int, int] = (1, 1)) -> Diagnostic:
    name, _ = LANGUAGE_CODES[code]
    return Diagnostic(code, name, "error", message, file, pos[0], pos[1])
