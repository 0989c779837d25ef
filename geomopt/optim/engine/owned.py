"""State kept with each whole matrix on the rank that owns it: where a stateful forward op runs
``OWNER`` on sharded tensors (the kronecker geometry:
:func:`~geomopt.optim.units.state_keys.owner_state`), each matrix is gathered whole on one rank,
fixed for the run, which alone keeps that matrix's state.

The owners are chosen once, when the optimizer's runtime is built, by a balanced split of the
tensors' matrix FLOPs (:func:`~geomopt.distributed.executors.assign`: the same on every rank), so the
state a rank keeps is the state of the matrices it computes at every step, and a checkpoint saved on
a mesh resumes on it. The entries are plain tensors laid out as the operators see the whole tensor,
in the owner's per-parameter state only (the factors in the rule's factor precision); the other
ranks keep none of them. A bucket's owned rows
are stacked for the op and split back into per-tensor entries after it, views of its rows, so the
next step reads that stack again instead of copying the state (rows whose step counts differ,
tensors that missed steps, step apart)."""

from __future__ import annotations

import torch

from geomopt.distributed.executors import assign, matrix_cost
from geomopt.geometry.forward import forward
from geomopt.optim.engine.tensors import count_tensor
from geomopt.optim.persist.state_codec import Codec
from geomopt.optim.units.state_keys import COUNTS


def owners(items: list, world: int) -> dict:
    """id(parameter) → the rank that owns its matrices, for ``items`` [(parameter, plan), …] (every
    tensor of the optimizer whose state is owned): longest first onto the least loaded rank."""
    costs = [matrix_cost(tuple(pp.op_shape), pp.matrix_cost) for _, pp in items]
    return {id(p): rank for (p, _), rank in zip(items, assign(costs, world))}


def rows_of(entries: list) -> torch.Tensor:
    """The entries (one per matrix, each of one shape) as one stack (n, …): where they are the rows,
    in order, of one buffer (what the last step bound them to), a view of that buffer, so a step
    copies none of its state; else a new stack (:func:`torch.stack`). Either way the same values."""
    first = entries[0]
    n, size = len(entries), first.numel()
    offsets = [e.storage_offset() for e in entries]
    if (size and all(e.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and e.shape == first.shape
                     and e.stride() == first.stride() and e.dtype == first.dtype for e in entries)
            and first.is_contiguous() and offsets == [offsets[0] + i * size for i in range(n)]):
        return first.as_strided((n, *first.shape), (size, *first.stride()), offsets[0])
    return torch.stack(entries)


def owned_forward(state_of, items: list, geometry, keys: tuple, radius: float = 1.0, out_dtype=None,
                  factors: str = "float32", step: int = 0):
    """The forward op of a bucket's ``items`` as an owner request's function ``fn(m, rows)``: ``m``
    the whole matrices of the bucket's rows ``rows`` (this rank's), each stepped with the state
    ``keys`` its parameter keeps here (``state_of``: torch's per-parameter state), created on its first
    step; returns ``(radius·∇φ₁*(m), None)``. The factors are stored in ``factors`` precision (the
    rule's ``state: {factors: …}``), rounded with the random bits one process uses for the tensor
    (its name, the group's ``step``, each entry's place in the whole matrix), so the owner stores what
    one process does."""

    def fn(m: torch.Tensor, rows: list):
        by_count: dict = {}
        for k, r in enumerate(rows):
            entry = state_of[items[r][0]]
            by_count.setdefault(tuple(int(entry[c]) if c in entry else -1 for c in keys if c in COUNTS),
                                []).append(k)
        out = None
        for ks in by_count.values():
            entries = [state_of[items[rows[k]][0]] for k in ks]
            state = Codec.decode({key: int(entries[0][key]) if key in COUNTS else rows_of([e[key] for e in entries])
                                  for key in keys if key in entries[0]})
            whole = len(ks) == len(rows)
            idx = torch.tensor(ks, device=m.device)
            y = forward(m if whole else m.index_select(0, idx), geometry, radius=radius, batch_dims=1,
                        out_dtype=out_dtype, state=state)
            if whole:
                out = y
            else:
                if out is None:
                    out = y.new_empty((len(rows), *y.shape[1:]))
                out[idx] = y
            if factors != "float32":
                state = Codec("float32", tuple(items[rows[k]][1].name for k in ks), step, factors=factors).encode(state)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    for e, row in zip(entries, value.unbind(0)):
                        e[key] = row
                else:  # a step count: one tensor for the rows, as a bucket's
                    count = count_tensor(value)
                    for e in entries:
                        e[key] = count
        return out, None

    return fn
