"""The optimizer's stacked state: a bucket's state tensors (momentum, Adam moments, a stage's second
moment, …) live stacked, one row per tensor, and each parameter's state entry is a view of its
row, so a batched step reads and writes them without copies. For sharded (DTensor) parameters the
entries are DTensors over the rows, laid out like the parameter (a stage's state: cut like it, or
replicated where it is a statistic over the cut dim)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, cast

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import contiguous_strides, is_dtensor
from geomopt.optim.persist.codes import side_shape
from geomopt.optim.units.state_keys import COUNTS, SIDE, STACKED, STAT_KEYS, VIEW_KEYS
from geomopt.optim.engine.tensors import as_real, count_tensor, flat_like, like_param, op_view, stack

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor



class StackedState:
    """``buffers``: (parameter ids, key) → the stacked tensor whose rows the entries view (and the
    flat buffers of the elementwise path, the kept scratch of CUDA graphs); ``reduced``:
    parameter ids → per stage state key, the stack dims its statistic sums out; ``layouts``:
    parameter id → :class:`~geomopt.distributed.layout.Layout` of a sharded parameter, in the
    operators' layout (set by the optimizer). Methods take the optimizer's
    ``state`` (torch's per-parameter dict), which load_state_dict may replace."""

    def __init__(self):
        self.buffers: dict = {}
        self.reduced: dict = {}
        self.layouts: dict = {}
        # (parameter ids, key) → the state entries bound to the buffer's rows: an entry that is not
        # one of them (load_state_dict, a user's assignment) makes the next gather restack; by
        # identity, which a compiler traces (a pointer comparison it does not)
        self.bound: dict = {}

    def gather(self, state, items: list, skip: tuple = ()) -> dict:
        """The state of a batched call: stacked tensors (the per-parameter state entries are views
        of them, so nothing is copied in steady state) and the shared step counts; not the keys
        ``skip`` (state each matrix's owner keeps alone: :mod:`geomopt.optim.engine.owned`)."""
        first = state[items[0][0]]
        ids = tuple(id(p) for p, _ in items)
        out = {}
        for key in STACKED:
            if key not in first or key in skip:
                continue
            buf: Optional[torch.Tensor] = self.buffers.get((ids, key))
            if buf is None or not self._bound(state, items, ids, key):
                # first use, or state replaced (load_state_dict): restack, in the memory layout a
                # step gives it (a lone tensor keeps its own, e.g. transposed), so that reductions
                # sum in the same order and a resumed run matches bit for bit
                buf = stack([state_row(state[p][key], pp, key) for p, pp in items]).clone()
            out[key] = buf
        for key in COUNTS:
            if key in first and key not in skip:
                out[key] = first[key]
        return out

    def _bound(self, state, items: list, ids: tuple, key: str) -> bool:
        """Whether the items' state entries under ``key`` are those bound to the buffer's rows."""
        bound = self.bound.get((ids, key))
        return bound is not None and all(state[p].get(key) is e for (p, _), e in zip(items, bound))

    def live(self, items: list, values: dict, keys: tuple) -> list:
        """The tensors of :meth:`gather`'s ``values`` under ``keys`` that are the state itself (the
        entries view them), not a fresh stack: what a bucket's in-place update changes at once."""
        ids = tuple(id(p) for p, _ in items)
        return [values[key] for key in keys if key in values and self.buffers.get((ids, key)) is values[key]]

    def scatter(self, state, items: list, values: dict) -> None:
        """Bind the per-parameter state entries to rows of the stacked ``values`` (DTensors over the
        rows for sharded parameters, laid out like the parameter)."""
        ids = tuple(id(p) for p, _ in items)
        reduced = self.reduced.get(ids, {})
        for key, value in values.items():
            if key in STACKED:
                if self.buffers.get((ids, key)) is value and self._bound(state, items, ids, key):
                    continue
                self.buffers[(ids, key)] = value
                for i, (p, pp) in enumerate(items):
                    state[p][key] = state_entry(value[i], p, pp, key, self.layouts.get(id(p)),
                                                reduced.get(key, ()))
                self.bound[(ids, key)] = tuple(state[p][key] for p, _ in items)
            elif key in COUNTS and not isinstance(value, torch.Tensor):
                count = count_tensor(value)  # the count the host computed, one tensor for the call's
                for p, _ in items:  # tensors (a step replaces it, never writes into it)
                    state[p][key] = count
            else:
                for p, _ in items:
                    state[p][key] = value

    def flat(self, state, items: list, xs: list, key: str, binds: Optional[list] = None) -> tuple:
        """The flat buffer of state ``key`` for a flat call and its per-parameter views (rebuilt
        when the entries are not its views: first step, or after load_state_dict). ``binds`` (a
        list): a rebuilt buffer's binding to the state entries is appended to it, for the caller
        to run once nothing it does can fail any more (the entries stay as they were until then)."""
        ids = tuple(id(p) for p, _ in items) + ("flat", key)
        buf = self.buffers.get(ids)
        entries = [state[p].get(key) for p, _ in items]
        if buf is not None and all(e is not None for e in entries):
            rows = [as_real(state_row(e, pp, key)) for e, (_, pp) in zip(entries, items)]
            if all(r._base is buf for r in rows):
                return buf, rows
        buf, views = flat_like(xs)
        if all(e is not None for e in entries):
            torch._foreach_copy_(views, [as_real(state_row(e, pp, key)) for e, (_, pp) in zip(entries, items)])
        else:
            buf.zero_()
        # a complex parameter's entry is complex, as torch's
        bound = [state_entry(like_param(v, p), p, pp, key) for v, (p, pp) in zip(views, items)]

        def bind():
            self.buffers[ids] = buf
            for entry, (p, _) in zip(bound, items):
                state[p][key] = entry

        if binds is None:
            bind()
        else:
            binds.append(bind)
        return buf, views

    def kept(self, items: list, name: str, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """A scratch buffer kept across steps for this call's tensors, for a CUDA graph that reads
        it in place; its contents are the caller's to overwrite."""
        key = tuple(id(p) for p, _ in items) + (name,)
        dtype = like.dtype if dtype is None else dtype
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, device=like.device)
        return buf


def state_row(entry: torch.Tensor, pp: ParamPlan, key: str) -> torch.Tensor:
    """A state entry as a row of its bucket's stacked state (local data, operators' layout)."""
    if not is_dtensor(entry):
        return entry
    local = cast("DTensor", entry).to_local()
    return op_view(local, pp) if key in VIEW_KEYS else local


def state_entry(row: torch.Tensor, p: torch.Tensor, pp: ParamPlan, key: str, layout=None,
                reduced: tuple = ()) -> torch.Tensor:
    """Inverse of :func:`state_row`: for a sharded parameter, a DTensor sharded like it. A stage's
    state (:data:`geomopt.optim.units.state_keys.STAT_KEYS`) has its own shape in the operators' layout
    (``layout``: the tensor's there): a statistic that sums out the stack dims ``reduced`` is cut
    like the tensor along the dims it keeps and replicated over the mesh dims that cut the others
    (every rank there holds the all-reduced values)."""
    if not is_dtensor(p):
        return row
    from torch.distributed.tensor import DTensor  # DTensor's package loads only where tensors are sharded

    p = cast(DTensor, p)
    if key.endswith(SIDE):  # int8 block scales, an int8-ec correction: the tensor's shape (operators' layout),
        side = side_shape(key, tuple(pp.op_shape))  # last dim in blocks or in pairs; a sharded tensor's int8
        return DTensor.from_local(row, p.device_mesh, layout.placements, run_check=False,  # blocks are aligned
                                  shape=torch.Size(side), stride=contiguous_strides(side))
    if key in STAT_KEYS:
        kept = [d for d in range(row.ndim) if d + 1 not in reduced]
        shape = list(row.shape)
        for d in kept:
            if layout.cuts[d]:
                shape[d] = pp.op_shape[d]
        placements = layout.statistic_placements(tuple(d - 1 for d in reduced))
        return DTensor.from_local(row, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_strides(shape))

    local = op_view(row, pp) if key in VIEW_KEYS else row
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
