"""The math, torch only: reference functions h, forward ops ∇φ*, spectral approximations,
backward ops (the prox table), radius presets, and the registry of kinds."""

from geomopt.geometry.forward import forward
from geomopt.geometry.reference import make_reference
from geomopt.geometry.registry import supported_constraints
from geomopt.geometry.scale import check_applicable, radius_scale
from geomopt.geometry.spectral import realized_reference

try:
    from geomopt.geometry.backward import backward
except ImportError as _exc:  # backward.py not there yet (or broken): fail when called, not on import
    _backward_error = _exc

    def backward(*args, **kwargs):
        raise ImportError(f"geomopt.geometry.backward is unavailable: {_backward_error}") from _backward_error


__all__ = [
    "forward",
    "backward",
    "make_reference",
    "realized_reference",
    "radius_scale",
    "check_applicable",
    "supported_constraints",
]
