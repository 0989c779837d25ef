"""GeomOptimizer, direction estimators, schedules, diagnostics."""

from geomopt.optim.load_check import CheckpointError
from geomopt.optim.checkpoint import spec_hash
from geomopt.optim.nonfinite import NonFiniteGradientError
from geomopt.optim.optimizer import GeomOptimizer

__all__ = ["CheckpointError", "GeomOptimizer", "NonFiniteGradientError", "spec_hash"]
