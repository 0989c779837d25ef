"""How an operator reads one tensor: its working dtype, the plain matrix, the row/column groups.

Every operator of :mod:`geomopt.geometry` (forward ops, spectral approximations, backward steps,
the stationarity gap) reads its input through these helpers, so the three readings are written
once:

* the working dtype (:func:`working_dtype`, :func:`upcast`): float64 for float64 input, float32
  otherwise (bfloat16 / float16 are upcast: their norms and divisions would put ~0.4% noise on
  every entry); results are cast back by the caller;
* the plain matrix of an element of shape ``S``: (S[0], prod(S[1:])) (a conv kernel
  (out, in, kh, kw) is one out × in·kh·kw matrix), with the leading ``batch_dims`` dims kept
  (:func:`matrix_view`) or merged into one batch (:func:`matrices`); each element as one flat
  vector: :func:`vectors`. Other readings (experts, blocks, kernel positions) are a geometry's
  ``view``: :mod:`geomopt.geometry.view`;
* the groups of the rowwise / columnwise geometries (:func:`by_rows`, :func:`groups`): rows of
  the logical (d_out, d_in) matrix for rowwise, its columns for columnwise; ``layout: in_out``
  stores that matrix transposed (GPT-2 Conv1D, embeddings), which swaps them.
"""

from __future__ import annotations

import math

import torch
from geomopt.compile.fragments import ResolvedGeometry


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype operators compute in for input of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its :func:`working_dtype` (``x`` itself when it already is)."""
    return x.to(working_dtype(x.dtype))


def matrix_view(d: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """Each element of ``d`` (shape ``B + S``, B = leading ``batch_dims`` dims) as the matrix
    (S[0], prod(S[1:])) (conv weights: out channels × the rest), B kept; ``.reshape(d.shape)``
    undoes it. Raises ValueError for elements with fewer than 2 dims."""
    shape = d.shape[batch_dims:]
    if len(shape) < 2:
        raise ValueError(f"a matrix view needs a tensor with at least 2 dims per element, got {tuple(shape)}")
    return d.reshape(*d.shape[:batch_dims], shape[0], math.prod(shape[1:]))


def matrices(x: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """(N, m, n): the plain matrix of every element, N = prod(batch shape); a scalar element is
    1 × 1, a vector m × 1."""
    shape = x.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    return x.reshape(-1, m, max(1, math.prod(shape[1:])))


def finite_or_zero(mats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``mats`` with each matrix that holds a NaN or ±∞ replaced by zeros, the flags of those
    matrices, shaped (..., 1, 1)). LAPACK's SVD and eigh raise on non-finite input; a caller
    decomposes the zeroed matrices and sets the flagged matrices' results to NaN, so a NaN goes
    through an exact decomposition as through a matmul (``on_nonfinite: off``: as in torch), with
    no host read."""
    bad = ~torch.isfinite(mats).flatten(-2).all(-1)[..., None, None]
    return torch.where(bad, 0, mats), bad


def vectors(x: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """(B, n): each element flattened, B = prod(batch shape) (1 when ``batch_dims`` = 0)."""
    return x.reshape(math.prod(x.shape[:batch_dims]), -1)


def by_rows(geometry: ResolvedGeometry) -> bool:
    """Whether the groups of a rowwise / columnwise ``geometry`` are the rows of the stored
    (shape[0], rest) matrix (rowwise with ``layout: out_in``, columnwise with ``in_out``) rather
    than its columns."""
    return (geometry.kind == "rowwise") != (geometry.layout == "in_out")


def groups(x: torch.Tensor, batch_dims: int, geometry: ResolvedGeometry) -> torch.Tensor:
    """(B, groups, len): the groups of a rowwise / columnwise ``geometry`` (:func:`by_rows`), the
    stored matrix transposed (a view, no copy) where they are its columns."""
    shape = x.shape[batch_dims:]
    m = shape[0] if len(shape) else 1
    mats = x.reshape(math.prod(x.shape[:batch_dims]), m, -1)
    return mats if by_rows(geometry) else mats.transpose(-2, -1)


def split_like(flat: torch.Tensor, xs: list) -> list:
    """Views of the 1-D ``flat`` shaped like the tensors ``xs``, in order (a flat buffer's pieces)."""
    return [v.view(x.shape) for v, x in zip(flat.split([x.numel() for x in xs]), xs)]
