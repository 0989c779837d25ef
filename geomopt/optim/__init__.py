"""GeomOptimizer, direction estimators, schedules, diagnostics."""

from geomopt.optim.load_check import CheckpointError
from geomopt.optim.optimizer import GeomOptimizer, NonFiniteGradientError, spec_hash

__all__ = ["CheckpointError", "GeomOptimizer", "NonFiniteGradientError", "spec_hash"]
