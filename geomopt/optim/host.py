"""What the parts of :class:`~geomopt.optim.GeomOptimizer` read from it: one annotated base class
for its mixins (bucket step, flat path, non-finite test, checkpoints, diagnostics), so a type
checker knows the attributes the optimizer sets up. Annotations only: at run time it is a plain
``object`` subclass with no attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

    from geomopt.compile.plan import ParamPlan, Plan
    from geomopt.optim.atomic import PendingStep
    from geomopt.optim.stacked import StackedState
    from geomopt.optim.workspace import Workspace
    from geomopt.spec.model import Spec


    _Base = Optimizer  # to a type checker, the parts are torch optimizers (super() reaches it)
else:
    _Base = object


class Host(_Base):
    """The optimizer's attributes, as its parts use them (besides torch.optim.Optimizer's)."""

    # the spec and its plan
    spec: Spec
    plan: Plan
    spec_hash: str
    _plans: list[list[ParamPlan]]  # per group, the plans of its parameters
    _buckets: list[list[list[int]]]  # per group, the parameter indices of each bucket
    _spec_groups: list[dict[str, Any]]
    _order: tuple[list[str], list[str]]
    _SPEC_KEYS: tuple[str, ...]
    # options
    track_gap: bool
    track_update: bool
    cuda_graphs: bool
    implementation: str
    # what a step uses
    _counters: list[dict[str, Any]]
    _pending: Optional[PendingStep]
    _stacked: StackedState
    _buffers: dict
    _workspace: Workspace
    _largest_bucket: int
    _executor: Any  # geomopt.distributed: LocalExecutor, ReplicatedExecutor or ShardedExecutor
    _sharded: bool
    _needs_closure: bool
    _graphs: dict
    _flag_host: Optional[torch.Tensor]
    _scale: Callable[[ParamPlan], float]  # the preset's factor ρ / radius of a tensor
