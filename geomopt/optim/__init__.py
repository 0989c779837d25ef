"""GeomOptimizer, direction estimators, schedules, diagnostics."""

from geomopt.optim.optimizer import GeomOptimizer, NonFiniteGradientError, spec_hash

__all__ = ["GeomOptimizer", "NonFiniteGradientError", "spec_hash"]
