"""Sharding bucket work across ranks (torch.distributed, DTensor): see :mod:`.executors`."""

from geomopt.distributed.executors import (
    FORWARD_LOCALITY, LOCAL, OWNER, REDUCE, LocalExecutor, ReplicatedExecutor, Request, ShardedExecutor,
    WorkCounter, assign, backward_locality, chunk_sizes, is_dtensor, make_executor,
)

__all__ = [
    "FORWARD_LOCALITY", "LOCAL", "OWNER", "REDUCE", "LocalExecutor", "ReplicatedExecutor", "Request",
    "ShardedExecutor", "WorkCounter", "assign", "backward_locality", "chunk_sizes", "is_dtensor", "make_executor",
]
