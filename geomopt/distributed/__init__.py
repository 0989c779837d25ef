"""Sharding bucket work across ranks (torch.distributed, DTensor): see :mod:`.executors`, and
:mod:`.layout` for where each rank's block of a DTensor lies (1-D and 2-D meshes).

``LOCAL``, ``REDUCE``, ``OWNER`` live in :mod:`geomopt.registry` (torch-free) and are re-exported
here; each operator declares its locality when it registers
(:func:`geomopt.geometry.operators.forward_locality`, :func:`~geomopt.geometry.operators.backward_locality`).
"""

from geomopt.distributed.executors import (
    LocalExecutor, ReplicatedExecutor, Request, ShardedExecutor, WorkCounter, assign, is_dtensor,
    make_executor,
)
from geomopt.registry import LOCAL, OWNER, REDUCE

__all__ = [
    "LOCAL", "OWNER", "REDUCE", "LocalExecutor", "ReplicatedExecutor", "Request", "ShardedExecutor", "WorkCounter",
    "assign", "is_dtensor", "make_executor",
]
