"""GeomOptimizer, direction estimators, schedules, diagnostics."""

from geomopt.optim.persist.load_check import CheckpointError
from geomopt.optim.persist.checkpoint import spec_hash
from geomopt.optim.engine.nonfinite import NonFiniteGradientError
from geomopt.optim.engine.optimizer import GeomOptimizer

__all__ = ["CheckpointError", "GeomOptimizer", "NonFiniteGradientError", "spec_hash"]
