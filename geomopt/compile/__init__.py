"""Matching names, modules and shapes to rules; the Plan. ``lint_spec`` is :func:`geomopt.lint.lint_spec`."""

from geomopt.compile.compiler import as_spec, compile_spec, plan_from_infos
from geomopt.compile.match import ParamInfo, glob_regex
from geomopt.compile.plan import ParamPlan, Plan
from geomopt.lint import lint_spec

__all__ = ["ParamInfo", "ParamPlan", "Plan", "as_spec", "compile_spec", "glob_regex", "lint_spec", "plan_from_infos"]
