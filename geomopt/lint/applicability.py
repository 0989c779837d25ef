"""Applicability: can the declared operators act at all? GO104 a geometry (or its view) that
cannot act on a tensor it owns, GO105 a (geometry, constraint) pair with no backward operator,
GO120 a post-stage that cannot act on a tensor its rule owns, GO126 a step scalar beyond the
tensor's floating-point range, GO127 a state precision the rule's state cannot be kept in. All five
are blocking errors
(:data:`geomopt.compile.blocking.BLOCKING`, where the checks live): compile refuses the spec, and
a suppression comment cannot silence them.
"""

from geomopt.compile.blocking import BLOCKING
from geomopt.lint.context import lint_rule

for code in ("GO104", "GO105", "GO120", "GO126", "GO127"):
    lint_rule(code, severity="error", **BLOCKING.meta[code])(BLOCKING[code])
