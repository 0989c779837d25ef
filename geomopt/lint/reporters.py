"""Reporters: diagnostics → text a person, a program or a CI system reads (``geomopt lint
--format text|json|github``). Each is registered in :data:`REPORTERS` as ``fn(diags, out)``.

* ``text``: ``file:line:col: severity CODE message``, one finding a line (as compilers print);
* ``json``: a list of objects with ``code``, ``name``, ``severity``, ``message``, ``file``,
  ``line`` and ``col``;
* ``github``: GitHub Actions workflow commands (``::warning file=…,line=…,col=…,title=…::…``), which
  annotate the pull request's diff; a note becomes a ``notice``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

from geomopt.registry import Registry
from geomopt.spec.diagnostics import Diagnostic

#: format name → ``fn(diags, out)``
REPORTERS: Registry = Registry("reporter")


@REPORTERS.register("text")
def text_report(diags: Iterable[Diagnostic], out) -> None:
    for d in diags:
        out.write(d.format() + "\n")


@REPORTERS.register("json")
def json_report(diags: Iterable[Diagnostic], out) -> None:
    json.dump([d.to_dict() for d in diags], out, indent=2, ensure_ascii=False)
    out.write("\n")


_GITHUB_LEVEL = {"error": "error", "warning": "warning", "note": "notice"}


@REPORTERS.register("github")
def github_report(diags: Iterable[Diagnostic], out) -> None:
    for d in diags:
        msg = d.message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        out.write(f"::{_GITHUB_LEVEL[d.severity]} file={d.file},line={d.line},col={d.col},"
                  f"title={d.code} {d.name}::{msg}\n")


def report(diags: list[Diagnostic], fmt: str = "text", out=None) -> None:
    """Write ``diags`` to ``out`` (default: stdout) in format ``fmt`` (a key of :data:`REPORTERS`)."""
    REPORTERS[fmt](diags, out or sys.stdout)


__all__ = ["REPORTERS", "github_report", "json_report", "report", "text_report"]
