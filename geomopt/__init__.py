"""geomopt: say, per parameter, which geometry it is optimized in and which set it stays in.

The public API (docs/guide/python.md, docs/guide/api.md) is re-exported here; everything else may move.
"""

from typing import TYPE_CHECKING

from geomopt.spec.diagnostics import Diagnostic, SpecError
from geomopt.spec.extends import shipped_specs
from geomopt.spec.model import Spec
from geomopt.spec.printers import dump_spec
from geomopt.spec.validate import load_spec, parse_spec
from geomopt.version import __version__

if TYPE_CHECKING:
    # seen by type checkers only; at runtime these load lazily through __getattr__ below
    from geomopt.compile.compiler import compile_spec
    from geomopt.compile.lock import RoutingChangedError
    from geomopt.functional import backward_step, forward_step
    from geomopt.lint.coverage import UnusedRuleWarning
    from geomopt.lint.roles import RolesGuessedWarning
    from geomopt.monitor import monitor_attention
    from geomopt.optim.engine.optimizer import GeomOptimizer

__all__ = ["Diagnostic", "Spec", "SpecError", "dump_spec", "load_spec", "parse_spec", "shipped_specs", "compile_spec",
           "forward_step", "backward_step", "GeomOptimizer", "RoutingChangedError", "UnusedRuleWarning",
           "RolesGuessedWarning", "monitor_attention", "__version__"]


def __getattr__(name: str) -> object:
    # torch-dependent parts load on first use, so `geomopt lint` starts fast
    if name == "compile_spec":
        from geomopt.compile.compiler import compile_spec
        return compile_spec
    if name in ("forward_step", "backward_step"):
        from geomopt import functional
        return getattr(functional, name)
    if name == "RoutingChangedError":
        from geomopt.compile.lock import RoutingChangedError
        return RoutingChangedError
    if name == "GeomOptimizer":
        from geomopt.optim.engine.optimizer import GeomOptimizer
        return GeomOptimizer
    if name == "UnusedRuleWarning":
        from geomopt.lint.coverage import UnusedRuleWarning
        return UnusedRuleWarning
    if name == "RolesGuessedWarning":
        from geomopt.lint.roles import RolesGuessedWarning
        return RolesGuessedWarning
    if name == "monitor_attention":
        from geomopt.monitor import monitor_attention
        return monitor_attention
    raise AttributeError(f"module 'geomopt' has no attribute {name!r}")
