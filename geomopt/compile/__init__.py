"""Matching names, modules and shapes to rules; the Plan."""

from geomopt.compile.compiler import as_spec, compile_spec, plan_from_infos
from geomopt.compile.match import ParamInfo, glob_regex
from geomopt.compile.plan import ParamPlan, Plan

__all__ = ["ParamInfo", "ParamPlan", "Plan", "as_spec", "compile_spec", "glob_regex", "plan_from_infos"]
