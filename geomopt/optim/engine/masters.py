"""The float32 weights a step works on for compensated bfloat16 parameters (a rule's
``state: {compensation: …}``; the arithmetic: :mod:`geomopt.optim.units.compensation`).

Before the engine runs, each such parameter with a gradient holds its float32 weight (decoded from
the bf16 value and the state's error) and a float32 copy of its gradient, so every step program
runs exactly as on a float32 model (its programs are chosen for float32:
:func:`~geomopt.optim.units.compensation.step_dtype`). After
it, the weight is stored again as bf16 + error and the parameter gets its own gradient back. A
skipped step (a non-finite gradient) restores the bf16 tensors untouched and writes no state; a
step that raises stores what it wrote (the parameters it had not reached decode and encode to
their own bits).

A sharded (DTensor) parameter (FSDP2, HSDP, FSDP2 × TP) runs on its local shard: the error is a DTensor
sharded like the parameter (one entry per local element, as every sharded state entry), the
float32 weight is decoded from the shard and its error, and the parameter holds it as a DTensor
of its own placements. A DTensor keeps its shard and its metadata in Python attributes that a
swap of ``.data`` does not reach (the wrapper's dtype changes, its shard does not), so the swap
moves them too (:func:`_held`). The result is written back into the shard's own storage, which
FSDP2 all-gathers from. Every rank keeps the error of every sharded weight a step
passed (a rank cannot see whether the other ranks' shards lost bits; the ranks' state must hold the
same keys for a distributed checkpoint), and none from the projection at construction: there an
optimizer must start with no state, which is how ``torch.distributed.checkpoint``'s
``get_state_dict`` knows to create it (a sharded weight projected onto its set at construction
is its projection rounded to bf16, as without compensation)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator, Optional, cast

import torch

from geomopt.distributed.executors import is_dtensor
from geomopt.optim.units.compensation import JOIN, KEY, LOW, SPLIT, compensated

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: parameter dtypes a compensated rule may also hold: they keep their value exactly
EXACT = (torch.float32, torch.float64)


class Masters:
    """The optimizer's compensated parameters: ``(parameter, compensation)`` pairs, in order."""

    def __init__(self, param_groups: list, plans: list):
        for g, pps in zip(param_groups, plans):
            kind = pps[0].compensation
            if kind == "none":
                continue
            other = [(pp.name, p.dtype) for p, pp in zip(g["params"], pps) if p.dtype not in (*LOW, *EXACT)]
            if other:
                name, dtype = other[0]
                raise ValueError(f"rule '{g['rule']}' has compensation {kind}, which keeps the rounding error of "
                                 f"bfloat16 weights, but '{name}' is {dtype}: cast it to bfloat16 or move it to a "
                                 f"rule without compensation")
            if not any(p.dtype in LOW for p in g["params"]):
                raise ValueError(f"rule '{g['rule']}' has compensation {kind}, but its tensors ('{pps[0].name}', …) "
                                 f"are all float32, which lose nothing: cast the model to bfloat16 "
                                 f"(model.to(torch.bfloat16)) or remove compensation from the rule")
        self.entries = [(p, pp.compensation) for g, pps in zip(param_groups, plans)
                        for p, pp in zip(g["params"], pps) if compensated(pp, p.dtype)]
        self.specs: dict = {}  # (id of a sharded parameter, dtype) → the DTensor spec of a tensor laid out like it

    @contextlib.contextmanager
    def around(self, state, every: bool = False) -> Iterator[list]:
        """Float32 weights and gradients in the parameters with a gradient (``every``: in all of
        them, gradients untouched: the projection at construction) while the block runs; the block
        sets ``flag[0] = False`` when the step was skipped (nothing written: nothing is stored). An
        error of 0 where none was kept stays unkept (a weight the block did not move)."""
        swapped = []
        flag = [True]
        try:
            for p, kind in self.entries:
                g = p.grad
                if g is None and not every:
                    continue
                err = state[p].get(KEY) if p in state else None
                held = _held(p)
                x = held[1].float() if err is None else JOIN[kind](held[1], _local(err))
                p.grad = None  # a gradient must match its tensor's dtype: swapped after the data
                xd = self.like(x, p)
                _hold(p, (xd, x, getattr(xd, "_spec", None)))
                p.grad = None if g is None else self.like(_local(g).float(), p)
                swapped.append((p, kind, held, g, _stores(err is not None, is_dtensor(p), every)))
            yield flag
        finally:
            for p, kind, held, g, store in swapped:
                if flag[0]:
                    new, err = SPLIT[kind](_local(p))
                    held[1].copy_(new)  # into the parameter's own storage (views of it, a wrapper's, stay bound)
                    if store or (store is None and bool(err.any())):
                        state[p][KEY] = self.like(err, p)
                p.grad = None
                _hold(p, held)
                p.grad = g

    def like(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``x``, this rank's elements, as a tensor laid out like ``p``: a DTensor of ``p``'s mesh,
        placements, shape and stride (an uneven shard included) where ``p`` is one. Made from a
        spec kept per parameter and dtype (``DTensor.from_local`` builds one each call, through
        an autograd function: most of a small step's time)."""
        if not is_dtensor(p):
            return x
        from torch.distributed.tensor import DTensor  # loads only where tensors are sharded
        from torch.distributed.tensor._dtensor_spec import TensorMeta

        key = (id(p), x.dtype)
        spec = self.specs.get(key)
        if spec is None:
            d = cast(DTensor, p)
            spec = self.specs[key] = dataclasses.replace(d._spec, tensor_meta=TensorMeta(d.shape, d.stride(), x.dtype))
        return DTensor(x, spec, requires_grad=False)


def _stores(kept: bool, sharded: bool, every: bool) -> Optional[bool]:
    """Whether the error is stored after the block: always where one was kept, and for a sharded
    weight a step passed (every rank alike); never for a sharded weight at the projection
    (nothing else is kept, as a distributed checkpoint expects); None: where it is not 0."""
    if kept or (sharded and not every):
        return True
    return False if sharded else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``t``: a DTensor's local shard (the tensor it holds), the data of
    any other tensor."""
    return cast("DTensor", t)._local_tensor if is_dtensor(t) else t.data


def _held(p: torch.Tensor) -> tuple:
    """What ``p`` holds: (its data, this rank's elements, a DTensor's spec or None). A DTensor's
    local shard and spec (the dtype its ops propagate) live in attributes of the Python object,
    which ``set_data`` leaves as they were."""
    return p.data, _local(p), cast("DTensor", p)._spec if is_dtensor(p) else None


def _hold(p: torch.Tensor, held: tuple) -> None:
    """Make ``p`` hold what :func:`_held` read (of ``p`` before, or of another tensor)."""
    p.data = held[0]
    if held[2] is not None:
        d = cast("DTensor", p)
        d._local_tensor, d._spec = held[1], held[2]
