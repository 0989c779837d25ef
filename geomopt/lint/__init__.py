"""``geomopt lint``: lint rules GO101–GO129, each a small registered unit with a code, a kebab-case
name, a severity and a docstring (with a bad and a fixed example) that ``geomopt rule CODE`` prints.

Modules, one concern each:

* :mod:`~geomopt.lint.context`: the registry :data:`RULES`, :func:`lint_rule`,
  :class:`LintContext` (what a rule reads) and :func:`run_rules`;
* rule families: :mod:`~geomopt.lint.coverage` (GO101–GO103, GO110–GO112: which rule owns each
  tensor), :mod:`~geomopt.lint.applicability` (GO104, GO105, GO120, GO126, GO127: blocking errors,
  whose checks live in :mod:`geomopt.compile.blocking`),
  :mod:`~geomopt.lint.values` (GO106–GO109, GO121, GO122, GO128, GO129: legal but suspect values and
  combinations), :mod:`~geomopt.lint.roles` (GO113–GO119, GO124, GO125: roles and views);
* :mod:`~geomopt.lint.suppress`: ``# geomopt: disable=CODE`` comments and GO123;
* :mod:`~geomopt.lint.runner`: :func:`lint_spec` with ``select=`` / ``ignore=``;
* :mod:`~geomopt.lint.reporters`: text, json and github output.

A new rule is a function in its family's module, decorated with :func:`lint_rule`, plus a failing
and a passing fixture in ``tests/lint_fixtures/`` (its README gives the format).
"""

# isort: skip_file
# Order matters: the rule families register in this order (the order `geomopt rule` lists them).
from geomopt.lint.context import RULES, LintContext, LintRule, lint_rule, rule_doc, run_rules
from geomopt.lint.runner import lint_spec, selected_codes
from geomopt.lint import coverage, applicability, values, roles, suppress  # noqa: F401  (register the rules)
from geomopt.lint.reporters import REPORTERS, report

__all__ = ["REPORTERS", "RULES", "LintContext", "LintRule", "lint_rule", "lint_spec", "report", "rule_doc",
           "run_rules", "selected_codes"]
