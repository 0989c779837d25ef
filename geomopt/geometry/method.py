"""``method: auto`` of the ``stiefel`` and ``spectral_ball`` constraints: exact or polar, chosen
where the backward step runs (the device and the matrix size are known only there).

The two methods (:func:`geomopt.geometry.prox.spectral.spectral_projection`): ``exact`` diagonalizes
the small Gram matrix (batched ``eigh``; the SVD where that is not as accurate), ``polar`` runs
SVD-free polar iterations (matrix products only; approximate, max-entry error ≤ 2e-6·r in fp32 on
training's steps, tests/test_prox_polar.py). ``exact`` and ``polar`` in a spec force one; ``auto``
(the default) is :func:`resolve_method`'s rule.
"""

from __future__ import annotations

import math
from typing import Sequence
from geomopt.spec.constraints import Constraint, SpectralBall, Stiefel

#: constraint kinds with a ``method`` field (and a polar step in geomopt.geometry.prox.polar)
METHOD_SETS = (Stiefel, SpectralBall)
METHOD_KINDS = ("stiefel", "spectral_ball")  # their kinds

#: matrices whose smaller side is at most this run ``exact`` under ``auto`` on CUDA
CUDA_BATCHED_EIGH_MAX = 32

#: the rule of :func:`resolve_method` in words (plan printing, ``geomopt explain``)
AUTO_RULE = f"exact on CPU, polar on CUDA where the smaller matrix side > {CUDA_BATCHED_EIGH_MAX}, exact otherwise"


def resolve_method(constraint: Constraint, device, shape: Sequence[int]) -> str:
    """``"exact"`` or ``"polar"``: the method the backward step of ``constraint`` (a spec
    constraint) runs for matrices of ``shape`` on ``device`` (a
    ``torch.device``, or its type as a string: ``"cuda"``, ``"cuda:1"``, ``"cpu"``). ``shape`` is
    one operand as the operator reads it, (m, n), or (m, *rest) read as m × prod(rest). Kinds
    without a polar step (spectral_sphere, rank, …) are always ``exact``.

    Rule for ``auto``: polar on CUDA where min(m, n) > 32, exact otherwise (CPU, CUDA matrices of
    smaller side ≤ 32, any other device). The exact step diagonalizes the min(m, n)-sided Gram
    matrix, and the measurements (benchmarks/RESULTS.md) say which way that goes:

    * CPU (2 threads, gpt-bench; the "SVD-free steps" sections since the Gram route): clipping
      exact 1.7–2.0× the unconstrained step, polar 2.8–3.1× (one batched LAPACK ``eigh`` of a
      256×256 Gram matrix costs as much as 6–10 of the ~48 small products the sign iteration
      needs); Stiefel exact 1.7–2.2×, polar 1.8–2.0×, a tie, and exact is accurate for any Y
      where polar assumes a step from the manifold. So exact at every size (bit for bit the
      former default there).
    * CUDA (H100, GPT-2 small, 768-wide, "Exact backward steps and SVD-free constraints"): exact
      404–407 ms per step, polar 42 ms (Stiefel) and 87 ms (clipping): torch's cuSOLVER ``eigh``
      uses the batched Jacobi solver (``syevjBatched``) only for n ≤ 32 and otherwise runs matrix
      by matrix (about 8 ms per 768×768 float32 matrix), while the polar iterations are batched
      products. n ≤ 32 is not measured: there the bucket's eigh is one batched launch, against
      the iterations' dozens of small launches and their host syncs, and exact is accurate for
      any Y, so exact. The threshold is torch's dispatch (``linalg_eigh_cusolver`` in
      aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp): revisit it with that.
    """
    if not isinstance(constraint, METHOD_SETS):
        return "exact"
    method = constraint.method
    if method != "auto":
        return method
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    if kind != "cuda" or not shape:
        return "exact"
    m, n = int(shape[0]), math.prod(int(s) for s in shape[1:])
    return "polar" if min(m, n) > CUDA_BATCHED_EIGH_MAX else "exact"
