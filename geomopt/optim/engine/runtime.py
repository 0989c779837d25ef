"""What the optimizer's steps keep between calls besides torch's ``state`` and ``param_groups``:
the executor that answers operator requests, the buckets' stacked state, the step's scratch, the
CUDA graphs and the pinned finiteness flag. One object, handed to the step functions
(:mod:`geomopt.optim.engine.bucket_step`, :mod:`geomopt.optim.engine.flat`, :mod:`geomopt.optim.engine.nonfinite`)
explicitly; a copy of the optimizer makes a new one (caches are not copied)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from geomopt.optim.engine.stacked import StackedState
from geomopt.optim.engine.workspace import Workspace


@dataclasses.dataclass
class Runtime:
    """``executor``: :mod:`geomopt.distributed`'s LocalExecutor, ReplicatedExecutor or
    ShardedExecutor; ``stacked``: the buckets' stacked state (and the sharded tensors' layouts);
    ``workspace``: scratch shared by buckets that run one after another (empty between steps:
    released at the end of each, except under ``capturable``); ``graphs``: bucket →
    :class:`~geomopt.optim.engine.graphs.GraphedOp`, at most ``graph_cap`` of them; ``flag_host``: the
    pinned host copy of the finiteness flag (CUDA); ``largest_bucket``: entries of the largest
    bucket, which bounds the flat path's blocks; ``owners``: id(parameter) → the rank that keeps its
    matrices' state and computes them (:mod:`geomopt.optim.engine.owned`; sharded tensors whose
    forward op keeps state)."""

    executor: Any
    stacked: StackedState = dataclasses.field(default_factory=StackedState)
    workspace: Workspace = dataclasses.field(default_factory=Workspace)
    graphs: dict = dataclasses.field(default_factory=dict)
    graph_cap: int = 0
    flag_host: Optional[torch.Tensor] = None
    largest_bucket: int = 1
    owners: dict = dataclasses.field(default_factory=dict)

    @property
    def buffers(self) -> dict:
        return self.stacked.buffers
