"""A bucket's operator requests (:class:`~geomopt.distributed.executors.Request`): its forward
op as the step runs it (the folded iteration under ``fuse``, replayed from a CUDA graph where the
program is graphed) and where a request runs when its tensors are sharded (the executor reads the
locality, the layout and the cost)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from geomopt.compile.fragments import ResolvedGeometry
from geomopt.distributed.executors import Request, is_dtensor
from geomopt.distributed.layout import whole_matrices
from geomopt.geometry.forward import forward
from geomopt.optim.engine import fused
from geomopt.optim.engine.graphs import GraphedOp
from geomopt.optim.engine.program import Program
from geomopt.optim.engine.runtime import Runtime
from geomopt.registry import OWNER


def forward_fn(prog: Program, rt: Runtime, items: list, geometry: ResolvedGeometry, radius: float = 1.0,
               out_dtype=None, state: Optional[dict] = None, traces: Optional[list] = None,
               last: Optional[list] = None, ranges: Optional[list] = None):
    """The bucket's forward op (``radius``·∇φ₁*, in ``out_dtype``); replayed from a CUDA graph
    (:mod:`geomopt.optim.engine.graphs`) where the program is ``graphed`` (the graph reads the bucket's
    kept scratch u in place when that is its input); ``traces``, ``last``, ``ranges``:
    :func:`fused.folding`'s; the first factor's hook only where ``ranges`` is given (the barrier
    reads them: a step without it, not deferred or capturable, keeps the folded form's scalings)."""
    fn = lambda m: (forward(m, geometry, radius=radius, batch_dims=1, out_dtype=out_dtype, state=state),  # noqa: E731
                    None)
    if prog.compiled:  # fuse: the polynomial iterations' folded form (no pre-normalization or transpose pass)
        fn = fused.folding(fn, traces, first=ranges is not None and not prog.graphed, held=last, ranges=ranges)
    if not prog.graphed:
        return fn
    ids = tuple(id(p) for p, _ in items)
    key = ids + (radius, out_dtype)  # the graph bakes both in
    op = rt.graphs.get(key)
    if op is None:
        if len(rt.graphs) >= rt.graph_cap:
            return fn  # buckets split by missing gradients in many ways: no graph per split
        op = rt.graphs[key] = GraphedOp(fn)
    op.scratch = rt.buffers.get(ids + ("u",))
    return op


def request(rt: Runtime, items: list, x: torch.Tensor, locality: str, fn) -> Request:
    """An operator request for a bucket (sharding read off its first parameter)."""
    p, pp = items[0]
    cost = pp.matrix_cost
    if not is_dtensor(p):
        return Request(fn, x, locality, cost=cost)
    layout = rt.stacked.layouts[id(p)]
    if locality == OWNER and whole_matrices(pp.geometry.view, layout.cuts):
        # experts cut whole across ranks: each rank's matrices (the cost: of its share of them)
        share = x[0].numel() / math.prod(pp.op_shape)
        return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape,
                       cost=None if cost is None else cost * share, whole=True)
    return Request(fn, x, locality, layout=layout, full_shape=pp.op_shape, cost=cost)


def owned_request(rt: Runtime, items: list, x: torch.Tensor, fn) -> Request:
    """An owner request whose rows each run on their fixed owner (:mod:`geomopt.optim.engine.owned`),
    which keeps their state: never computed where the blocks lie, even if a matrix lies whole there."""
    p, pp = items[0]
    return Request(fn, x, OWNER, layout=rt.stacked.layouts[id(p)], full_shape=pp.op_shape, cost=pp.matrix_cost,
                   owners=tuple(rt.owners[id(q)] for q, _ in items))
