"""Matrix views: how one tensor is read as a batch of matrices (geometry field ``view``).

A resolved view (the compiler writes it into each plan's geometry, in the operators' layout) is a
frozen :class:`~geomopt.compile.fragments.View` (``batch``, ``trailing``, ``blocks``, ``factors``, …)
over an element of shape ``S``, read by attribute:

* ``batch`` b: ``S[:b]`` index separate matrices (MoE experts: b = 1, an (E, out, in) tensor is
  E matrices);
* the rows are ``S[b]``; the columns ``S[b+1:]`` merged (``trailing: cols``: a conv kernel
  (out, in, kh, kw) is one out × in·kh·kw matrix), or ``S[b+1]`` alone with ``S[b+2:]`` indexing
  separate matrices (``trailing: batch``: one out × in matrix per kernel position);
* ``blocks``: the rows cut into consecutive blocks of these sizes, each its own matrix (fused
  q, k, v; fused [gate, up]; heads);
* ``factors``: per block, its scale preset's radius over block 0's (the plan's radius is block
  0's); None when every block has the same radius. ``scale_constraint``: a ``relative``
  constraint's radius scales by the same factors. ``layout: in_out`` (from the model's structure:
  experts stored (E, in, out)): each matrix is stored transposed, which only the scale presets
  read (the spectral maps commute with transposition).

No view (None) is the plain (S[0], prod(S[1:])) matrix every operator reads by itself
(:mod:`geomopt.geometry.matrix`). The operators never see a view: :func:`apply` turns the tensor
into one stacked (N, m, n) batch per block size (a reshape, no copy, for expert batches and equal
blocks), calls the operator on each with ``batch_dims=1`` and puts the results back.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union, cast

import torch
from geomopt.compile.fragments import ResolvedGeometry, View
from geomopt.spec.base import field
from geomopt.spec.geometries import AutoView, Geometry
from geomopt.spec.geometries import View as SpecView

Groups = list[tuple[int, list[int]]]  # (block size, indices of the blocks of that size)


def resolve(view: Optional[SpecView], shape: tuple[int, ...], structure: Optional[dict] = None) -> Optional[View]:
    """The concrete view of a spec ``view`` (``auto`` or ``matrix(…)``; None: none) for a tensor of
    ``shape`` (operators' layout), without block factors (the compiler adds them). ``structure``:
    what the model says of the tensor (``{"batch": 1}`` for expert weights, ``{"blocks": [...]}``
    for fused projections), read by ``auto``. Raises ValueError saying why the view does not fit."""
    if view is None:
        return None
    shape = tuple(int(s) for s in shape)
    layout = None
    blocks: Union[int, list[int], None]
    if isinstance(view, AutoView):
        structure = structure or {}
        batch, trailing, blocks = int(structure.get("batch", 0)), "cols", structure.get("blocks")
        layout = structure.get("layout")
        if len(shape) < batch + 2:  # structure from a name heuristic that this shape contradicts
            batch, blocks, layout = 0, None, None
    else:
        batch, trailing, blocks = view.batch, view.trailing, view.blocks
    need = batch + 2
    if len(shape) < need:
        raise ValueError(f"view batch={batch} needs at least {need} dims (batch axes, rows, columns), "
                         f"got shape {shape}")
    rows = shape[batch]
    if isinstance(blocks, int):
        if rows % blocks:
            divisors = [k for k in range(2, rows + 1) if rows % k == 0][:6]
            raise ValueError(f"view blocks={blocks} does not divide the rows (axis {batch}, size {rows}) of shape "
                             f"{shape} into equal blocks; divisors of {rows}: {divisors or 'none above 1'}")
        blocks = [rows // blocks] * blocks
    elif blocks is not None:
        blocks = [int(b) for b in blocks]
        if sum(blocks) != rows:
            raise ValueError(f"view blocks={blocks} sum to {sum(blocks)}, but the rows (axis {batch}) of shape "
                             f"{shape} number {rows}")
    if blocks is not None and len(blocks) == 1:
        blocks = None
    if batch == 0 and blocks is None and (trailing == "cols" or len(shape) == 2):
        return None  # the plain matrix
    # layout in_out: each matrix stored (in, out), which the scale presets read transposed
    return View(batch, trailing, None if blocks is None else tuple(blocks),
                layout="in_out" if layout == "in_out" else None)


def concrete(geometry: Union[ResolvedGeometry, Geometry], shape: tuple[int, ...]) -> Optional[View]:
    """The resolved view of a geometry for an element of ``shape``: a plan's (already resolved), or
    a spec geometry's ``view`` resolved here without structure (the lint's and ranges' shapes)."""
    if isinstance(geometry, ResolvedGeometry):
        return geometry.view
    return resolve(field(geometry, "view"), tuple(shape))


def matrix_shapes(view: Optional[View], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(rows, cols) of each distinct block, in block order (one entry without blocks)."""
    shape = tuple(int(s) for s in shape)
    if view is None:
        return [(shape[0] if shape else 1, math.prod(shape[1:]))]
    b = view.batch
    cols = shape[b + 1] if view.trailing == "batch" and len(shape) > b + 1 else math.prod(shape[b + 1:])
    sizes = view.blocks or [shape[b]]
    return [(s, cols) for s in sizes]


def count(view: Optional[View], shape: tuple[int, ...]) -> int:
    """How many matrices one tensor of ``shape`` holds under ``view``."""
    if view is None:
        return 1
    b = view.batch
    n = math.prod(shape[:b]) * len(view.blocks or [0])
    return n * (math.prod(shape[b + 2:]) if view.trailing == "batch" else 1)


def cost(view: Optional[View], shape: tuple[int, ...]) -> Optional[float]:
    """Σ m·n·min(m, n) over the matrices of one tensor under ``view`` (the distributed executors'
    work estimate); None without a view."""
    if view is None:
        return None
    shapes = matrix_shapes(view, shape)
    per = count(view, shape) // len(shapes)
    return float(sum(per * m * n * min(m, n) for m, n in shapes))


def describe(view: Optional[View], shape: tuple[int, ...]) -> str:
    """"4 × 256×64", "3 × 64×64", "64×192" (blocks of different sizes: "64×64 + 2 × 16×64")."""
    shapes = matrix_shapes(view, shape)
    per = count(view, shape) // len(shapes) if view is not None else 1
    parts: list[str] = []
    for (m, n) in dict.fromkeys(shapes):
        k = per * shapes.count((m, n))
        parts.append(f"{k} × {m}×{n}" if k > 1 else f"{m}×{n}")
    return " + ".join(parts)


def _groups(view: View) -> Groups:
    out: dict[int, list[int]] = {}
    for i, s in enumerate(view.blocks or ()):
        out.setdefault(s, []).append(i)
    return list(out.items())


def _canonical(x: torch.Tensor, batch_dims: int, view: View) -> torch.Tensor:
    """(N, rows, cols): every matrix of every batch element, blocks not yet cut."""
    shape = x.shape[batch_dims:]
    b = view.batch
    nb = math.prod(x.shape[:batch_dims]) * math.prod(shape[:b])
    rows = shape[b]
    if view.trailing == "batch" and len(shape) > b + 2:
        cols, extra = shape[b + 1], math.prod(shape[b + 2:])
        return x.reshape(nb, rows, cols, extra).permute(0, 3, 1, 2).reshape(nb * extra, rows, cols)
    return x.reshape(nb, rows, math.prod(shape[b + 1:]))


def _restore(mats: torch.Tensor, like: torch.Tensor, batch_dims: int, view: View) -> torch.Tensor:
    shape = like.shape[batch_dims:]
    b = view.batch
    if view.trailing == "batch" and len(shape) > b + 2:
        rows, cols, extra = shape[b], shape[b + 1], math.prod(shape[b + 2:])
        mats = mats.reshape(-1, extra, rows, cols).permute(0, 2, 3, 1)
    return mats.reshape(like.shape)


def apply(x: torch.Tensor, batch_dims: int, view: View, fn: Callable) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``fn(mats, factor) -> (out, flag)`` on each stack of same-shape matrices (N, m, n) of ``x``
    (flag None or one bool per matrix); returns (out in ``x``'s shape, per-element flag (shape
    ``x.shape[:batch_dims]``) or None). One call without blocks or with equal blocks."""
    mats = _canonical(x, batch_dims, view)
    n_el = math.prod(x.shape[:batch_dims])
    blocks = view.blocks
    factors = view.factors or None
    if blocks is None or len(set(blocks)) == 1 and factors is None:
        k = len(blocks) if blocks else 1
        out, flag = fn(mats.reshape(-1, mats.shape[1] // k, mats.shape[2]), 1.0)
        out = _restore(out.reshape(mats.shape), x, batch_dims, view)
        return out, None if flag is None else flag.reshape(n_el, -1).any(-1).reshape(x.shape[:batch_dims])
    offsets = [0]
    for s in blocks:
        offsets.append(offsets[-1] + s)
    result = None
    flags = None
    for size, idx in _groups(view):
        part = torch.stack([mats[:, offsets[i]:offsets[i] + size] for i in idx], 1).reshape(-1, size, mats.shape[2])
        out, flag = fn(part, factors[idx[0]] if factors else 1.0)
        out = out.reshape(mats.shape[0], len(idx), size, mats.shape[2])
        if result is None:
            result = torch.empty(mats.shape, dtype=out.dtype, device=out.device)
        for j, i in enumerate(idx):
            result[:, offsets[i]:offsets[i] + size] = out[:, j]
        if flag is not None:
            f = flag.reshape(n_el, -1).any(-1)
            flags = f if flags is None else flags | f
    # blocks is not None here, so the loop ran and set result
    out = _restore(cast(torch.Tensor, result), x, batch_dims, view)
    return out, None if flags is None else flags.reshape(x.shape[:batch_dims])


def reduce(x: torch.Tensor, batch_dims: int, view: View, fn: Callable, *others: torch.Tensor) -> torch.Tensor:
    """Σ over the matrices of each element of ``fn(mats, *other_mats, factor)`` (one value per
    matrix): per-element sums such as a nuclear norm or a stationarity gap, in shape
    ``x.shape[:batch_dims]``."""
    n_el = math.prod(x.shape[:batch_dims])
    mats = [_canonical(t, batch_dims, view) for t in (x, *others)]
    blocks = view.blocks or [mats[0].shape[1]]
    factors = view.factors or [1.0] * len(blocks)
    total = None
    offset = 0
    for i, size in enumerate(blocks):
        vals = fn(*(m[:, offset:offset + size] for m in mats), factors[i])
        offset += size
        part = vals.reshape(n_el, -1).sum(-1)
        total = part if total is None else total + part
    return cast(torch.Tensor, total).reshape(x.shape[:batch_dims])  # blocks is never empty
