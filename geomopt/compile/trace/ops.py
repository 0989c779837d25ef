"""What the dispatch tracer (:mod:`geomopt.compile.trace.dispatch`) reads and keeps: the tables
of aten ops it treats alike (views and copies that hand a tensor on, row cuts, lookups by index,
fused recurrent kernels, ops that read only a tensor's metadata) and its records of a tensor's
uses and of the activations that flow between ops."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from geomopt.compile.trace.families import INDEX_OPS
from geomopt.compile.trace.blocks import Feat

aten = torch.ops.aten

# ops that hand on (a view of, or a copy of) their first tensor argument
VIEWS = frozenset({
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.t, aten.transpose, aten.permute,
    aten.expand, aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach, aten.clone,
    aten._to_copy, aten.contiguous, aten.as_strided, aten.unbind, aten.split, aten.split_with_sizes, aten.chunk,
    aten.unsafe_split, aten.narrow, aten.flatten, aten.unflatten, aten.movedim, aten.view_as_real,
    aten.view_as_complex, aten.lift_fresh, aten._conj, aten.resolve_conj, aten.resolve_neg, aten.repeat,
    aten.lift_fresh_copy, aten.numpy_T, aten.mT, aten.squeeze_copy, aten.view_copy, aten.t_copy,
    aten.transpose_copy, aten.permute_copy, aten.expand_copy, aten.unsqueeze_copy, aten.select_copy,
    aten.slice_copy, aten.unbind_copy, aten.split_copy, aten.split_with_sizes_copy, aten.detach_copy,
    aten.alias_copy, aten._unsafe_index_put, aten.index_put,
}) | INDEX_OPS
SELECTS = frozenset({aten.select, aten.select_copy})
PLAIN_VIEWS = VIEWS - SELECTS - INDEX_OPS
LOOKUP_INDEX = frozenset({aten.index, aten._unsafe_index, aten.index_select})  # rows (or matrices) by index
# fused recurrent kernels (what ``nn.LSTM``/``GRU``/``RNN`` reach on CUDA): a cuDNN or MIOpen mode's gates
# per layer, and the CUDA cells that take the two gate products of one step whole
FUSED_RNN = frozenset(op for op in (getattr(aten, "_cudnn_rnn", None), getattr(aten, "_miopen_rnn", None))
                       if op is not None)
RNN_MODES = {0: ("RNN_RELU", 1), 1: ("RNN_TANH", 1), 2: ("LSTM", 4), 3: ("GRU", 3)}
FUSED_CELLS = {op: gates for op, gates in ((getattr(aten, "_thnn_fused_lstm_cell", None), 4),
                                            (getattr(aten, "_thnn_fused_gru_cell", None), 3)) if op is not None}
ROW_CUTS = frozenset({aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk, aten.slice, aten.narrow,
                       aten.split_copy, aten.split_with_sizes_copy, aten.slice_copy})

# ops that read a tensor for its shape, dtype and device only: their outputs are constants
LIKE = frozenset({aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
                   aten.randn_like, aten.randint_like, aten.new_zeros, aten.new_ones, aten.new_empty,
                   aten.new_full, aten.new_empty_strided, aten.empty_strided, aten.sym_size, aten.sym_numel,
                   aten.sym_stride, aten.sym_storage_offset})


@dataclasses.dataclass
class Use:
    """How the trace saw one parameter consumed."""

    family: str  # a family of :mod:`geomopt.compile.trace.families`
    op: str  # the aten op that decided it ("aten.addmm")
    detail: str = ""  # "groups=128", "through select (a stack of matrices)"


# ---------------------------------------------------------------- bookkeeping per tensor


class Ref(NamedTuple):
    """A tensor derived from parameters only: which, and how."""

    params: frozenset  # parameter indices
    batched: bool = False  # whole matrices of a ≥ 3-D tensor selected along its leading dim
    indexed: bool = False  # rows of a table gathered by an index op (a lookup)
    computed: bool = False  # through an op that is not a view (a sum with a constant, a norm)
    dims: Optional[tuple] = None  # per dim: the parameter's dims it holds (one parameter, views only)
    rows: Optional[tuple] = None  # (start, stop): the parameter's rows a split or slice kept
    normed: str = ""  # the normalization op it went through (``native_layer_norm``)


class Act(NamedTuple):
    """An activation: the layers whose outputs reach it with no layer between (``src``), whether it
    comes from the model's inputs alone (``raw``), and where a layer's features sit (``feat``)."""

    src: frozenset = frozenset()
    raw: bool = False
    feat: Optional[Feat] = None




class IdMap:
    """Tensor → value by identity, keeping each tensor alive for the trace (so no id is reused);
    the tensors of one small or meta forward cost little to keep."""

    __slots__ = ("items",)

    def __init__(self):
        self.items: dict[int, tuple] = {}  # id → (tensor, value): the tracer's hot loop reads it directly

    def get(self, t, default=None):
        hit = self.items.get(id(t))
        return default if hit is None else hit[1]

    def __contains__(self, t) -> bool:
        return id(t) in self.items

    def __getitem__(self, t):
        return self.items[id(t)][1]

    def __setitem__(self, t, value) -> None:
        self.items[id(t)] = (t, value)


_Tensor = torch.Tensor


def tensors_in(x) -> list:
    """The tensors in an op's arguments or outputs (tensors, and lists/tuples of them, two deep)."""
    if isinstance(x, _Tensor):
        return [x]
    if isinstance(x, dict):
        x = tuple(x.values())
    elif not isinstance(x, (tuple, list)):
        return []
    out = [a for a in x if isinstance(a, _Tensor)]
    for a in x:
        if isinstance(a, (tuple, list)):
            out.extend(b for b in a if isinstance(b, _Tensor))
    return out


def written(func, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes in place: its schema's mutable arguments (``clamp_``'s self,
    ``copy_``'s destination, an ``out=``); ``set_``, which rebinds a tensor to other memory and
    writes none, has none."""
    schema = func._schema
    if not schema.is_mutable or func.overloadpacket is aten.set_:
        return []
    out: list = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out += tensors_in(args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name))
    return out


__all__ = ["Act", "IdMap", "Ref", "Use"]
