"""The spec language: models, YAML and DSL front ends, printers, diagnostics."""

from geomopt.spec.diagnostics import Diagnostic, SpecError
from geomopt.spec.extends import shipped_specs
from geomopt.spec.model import Spec
from geomopt.spec.printers import dump_spec
from geomopt.spec.validate import load_spec, parse_spec, source_of

__all__ = ["Diagnostic", "Spec", "SpecError", "dump_spec", "load_spec", "parse_spec", "shipped_specs", "source_of"]
