"""CUDA graphs for the optimizer's Newton–Schulz / Polar Express forward ops.

A bucket's polynomial iteration is some 25 kernel launches of fixed shapes and no host
synchronization. In eager mode each launch costs the host tens of microseconds (cuBLAS's
heuristics included), which on a GPT-2-small sized model is more than the GPU's time for the
whole step. :class:`GraphedOp` captures the op once per bucket and replays it: one launch.

The input is copied into a buffer the graph owns (so the op may be handed any tensor), or read
in place when it is a scratch buffer the caller names (Nesterov's u). The output lives in the
graph's private memory pool: it is valid until the next replay of the same graph, which is the
next step. The optimizer consumes it within the step, so replay is safe there; the functional
API never uses it. Pools are not shared between graphs: a graph captured later could place its
output in memory that an earlier graph uses for temporaries, which that graph's replay would
then overwrite before the output is read (seen on an H100: a shared pool broke the test
against eager execution).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def can_graph(x: torch.Tensor) -> bool:
    """A CUDA tensor, and no capture already under way (a user capturing the whole step)."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing()


class GraphedOp:
    """``fn(x) -> (out, flags)`` replayed from a CUDA graph; captured on first use and again
    when x's shape, dtype or device changes; ``fn`` itself where :func:`can_graph` is false."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_in: Optional[torch.Tensor] = None
        self.static_out = None
        # a scratch tensor of the caller's that the graph may read in place (no copy): set by the
        # caller before a call whose input is that scratch, whose contents it may overwrite
        self.scratch: Optional[torch.Tensor] = None

    def __call__(self, x: torch.Tensor):
        if not can_graph(x):
            return self.fn(x)
        s = self.static_in
        if s is None or s.shape != x.shape or s.dtype != x.dtype or s.device != x.device or s.stride() != x.stride():
            self._capture(x)
        assert self.static_in is not None and self.graph is not None  # captured above
        if x.data_ptr() != self.static_in.data_ptr():
            self.static_in.copy_(x)
        self.graph.replay()
        return self.static_out

    def _capture(self, x: torch.Tensor) -> None:
        self.static_in = x if x is self.scratch else x.detach().clone()
        # warm up on a side stream (cuBLAS handles and workspaces are made outside the capture)
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            self.fn(self.static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_out = self.fn(self.static_in)
