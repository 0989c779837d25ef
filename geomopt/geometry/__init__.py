"""The math, torch only: reference functions h, forward ops ∇φ*, spectral approximations,
backward ops (the prox table, :mod:`geomopt.geometry.prox`), radius presets, and the registries
of kinds. How every operator reads a tensor (working dtype, plain matrix, row/column groups) is
:mod:`geomopt.geometry.matrix`; matrix views (experts, blocks) are :mod:`geomopt.geometry.view`.

Importing the package registers every unit: the registries (:mod:`geomopt.geometry.operators`,
``APPROX_OPS`` in :mod:`~geomopt.geometry.spectral`, ``REFERENCES`` in
:mod:`~geomopt.geometry.reference`) import no op module, and the op modules, imported here, fill
them.
"""

# the op modules: importing them registers their units
from geomopt.geometry.reference import make_reference
from geomopt.geometry import spectral  # noqa: F401  (its approximations)
from geomopt.geometry import learned  # noqa: F401  (the kronecker forward op)
from geomopt.geometry.forward import forward
from geomopt.geometry.prox import backward

from geomopt.geometry.scale import check_applicable, radius_scale
from geomopt.support import realized_reference, supported_constraints

__all__ = [
    "forward",
    "backward",
    "make_reference",
    "realized_reference",
    "radius_scale",
    "check_applicable",
    "supported_constraints",
]
