"""The dispatch mode behind :mod:`geomopt.compile.trace`: every aten op of one forward, the
parameters it reads and how (an op family of :mod:`geomopt.compile.trace.families`), and what flows
along the activations (the layers whose outputs reach them, whether they come from the raw input
alone, where a layer's output features sit: :mod:`geomopt.compile.trace.blocks`).

A parameter is followed through views, casts, selects and index gathers, and through ops that read
only parameters (weight norm, ``-exp(A_log)``: a *derived* tensor); an op that reads a parameter
together with an activation is a use; an op of the matmul, convolution or lookup family with a
parameter operand is a *layer call*, whose output starts a new activation.

Views from use: along a parameter's views the tracer keeps which of its dims each view dim holds
and which of its rows a split or slice kept, so a matmul tells the matrices of a batched
parameter (``einsum`` over a (3, 64, 64) tensor: 3 of 64 × 64) and a weight split before use gives
its row blocks (``nn.MultiheadAttention`` with separate query and key/value inputs); two layers'
outputs summed feature by feature (an LSTM cell's input and hidden gates) share their cuts; a fused
recurrent kernel (``_cudnn_rnn``, CUDA's fused LSTM and GRU cells) gives its mode's gates.

Lookups are lookups: rows of a table (a 2-D tensor, or one computed from a parameter: an
interpolated position table) gathered by ``index`` are looked up, and stay so when they are then
multiplied (a decomposed relative-position bias); only whole matrices of a ≥ 3-D tensor selected
along its leading dim (experts) are a stack of matrices. A tensor whose first consumer is a
normalization (``layer_norm`` of learned latents) or an elementwise op with the activations (a
position table added to the tokens), and a parameter with fewer than two dims above size 1 (a
(1, 1, d) learned query token) are a layer's *input*, never its weight.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from geomopt.compile.trace.families import (FAMILIES, GROUPED_MM, INDEX_OPS, NORMALIZATIONS, Family, contracted_dim,
                                          conv_family, family_of)
from geomopt.compile.trace.blocks import Feat, dim_index, follow, leading_batch, view_dims
from geomopt.compile.trace.meta import run_memoized, value_free

from geomopt.compile.trace.ops import (FUSED_CELLS, FUSED_RNN, LIKE, LOOKUP_INDEX, PLAIN_VIEWS, RNN_MODES,
                                      ROW_CUTS, SELECTS, VIEWS, Act, IdMap, Ref, Use, tensors_in, written)

aten = torch.ops.aten
_OPS: dict = {}  # op → (overload packet, family, whether its outputs are constants)


class Tracer(TorchDispatchMode):
    """The dispatch mode: classifies each op's parameter operands and propagates the bookkeeping."""

    def __init__(self, params: list[torch.Tensor], value_free: bool, names: Optional[list[str]] = None):
        super().__init__()
        # a real forward's stand-ins share the parameters' memory: an op writing to it is refused
        self.memory = {} if value_free else {p.untyped_storage().data_ptr(): (names or [])[i:i + 1]
                                             for i, p in enumerate(params) if p.numel() and p.layout == torch.strided}
        self.refs = IdMap()
        self.acts = IdMap()
        for i, p in enumerate(params):
            self.refs[p] = Ref(frozenset((i,)), dims=tuple(frozenset((d,)) for d in range(p.ndim)))
        self.shapes = [tuple(p.shape) for p in params]
        self.lead = [0] * len(params)  # leading dims indexing separate matrices, from a matmul's contraction
        self.view_ops: list[dict[str, None]] = [{} for _ in params]  # ops whose cuts made the blocks
        self.offsets: dict[tuple[int, int], int] = {}  # (layer call, weight) → first row of the weight it used
        self.joints: list[frozenset] = []  # weights of layers whose outputs were summed feature by feature
        self.first: dict[int, str] = {}  # parameter → its first consumer, when a normalization or elementwise op
        self.uses: list[dict[str, Use]] = [{} for _ in params]
        self.batched = [False] * len(params)
        self.stems: list[Optional[str]] = [None] * len(params)
        self.reads_input = [False] * len(params)
        self.calls: list[frozenset] = []  # per layer call (an op reading weights): the weights' indices
        self.fed: set[int] = set()  # layer calls whose output entered another parameterized layer
        self.fed_log: list[int] = []  # the same, in the order they were found
        self.replayed = 0
        self.pieces: dict[int, set] = {}  # weight → {(start, stop)} cuts of its layers' output features
        self.value_free = value_free
        self.memo: dict = {}  # (op, input metadata) → output metadata, for meta kernels (repeated blocks)

    # ------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = NotImplemented
        if self.value_free:
            out = value_free(func, args, kwargs)
            if out is NotImplemented:
                out = run_memoized(self.memo, func, args, kwargs)
        if out is NotImplemented:
            hit = [self.memory[m] for t in written(func, args, kwargs) if self.memory
                   and t.layout == torch.strided and (m := t.untyped_storage().data_ptr()) in self.memory]
            if hit:
                raise RuntimeError(f"the forward writes in place to parameter '{''.join(hit[0]) or '?'}' ({func}): "
                                   f"a trace never changes the model, so it stops there")
            out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 (bookkeeping never breaks the forward; the op is just not recorded)
            pass
        return out

    def mark_fed(self, calls) -> None:
        """Layer calls whose output entered another parameterized layer (logged for the replayer)."""
        for c in calls:
            if c not in self.fed:
                self.fed.add(c)
                self.fed_log.append(c)

    def param_index(self, t) -> Optional[int]:
        """The index of a parameter's stand-in, or None for any other tensor."""
        r = self.refs.get(t)
        return next(iter(r.params)) if r is not None and len(r.params) == 1 and not r.computed else None

    tensors_of = staticmethod(tensors_in)

    def src(self, t) -> frozenset:
        """The layer calls whose outputs reach activation ``t`` (none for any other tensor)."""
        act = self.acts.get(t)
        return frozenset() if act is None else act.src

    def _record(self, func, args, kwargs, out) -> None:
        info = _OPS.get(func)
        if info is None:
            info = _OPS[func] = (func.overloadpacket, family_of(func), func.overloadpacket in LIKE)
        packet, fam, like = info
        if like:
            return  # zeros_like and kin: constants
        leaves = tensors_in(args) + (tensors_in(kwargs) if kwargs else [])
        refs, acts = self.refs.items, self.acts.items
        params_in: list[tuple[torch.Tensor, Ref]] = []
        acts_in: list[tuple[torch.Tensor, Act]] = []
        for a in leaves:
            hit = refs.get(id(a))
            if hit is not None:
                params_in.append((a, hit[1]))
                continue
            hit = acts.get(id(a))
            if hit is not None:
                acts_in.append((a, hit[1]))
        if not params_in and not acts_in:
            return  # constants only (factories, buffers): nothing to follow
        outs = tensors_in(out)
        if fam is not None and fam.name == "conv":
            fam = conv_family(args)
        if packet in LOOKUP_INDEX and acts_in and id(args[0]) in refs and not self._whole_matrices(packet, args):
            fam = FAMILIES["lookup"]  # table[ids] with ids from the input: a lookup, as embedding is
            operands: tuple = (0,)
        else:
            operands = fam.operands(func, args) if fam is not None and params_in else ()
        weight_pos = [p for p in operands if p < len(args) and isinstance(args[p], torch.Tensor)
                      and id(args[p]) in refs and self._weight_like(refs[id(args[p])][1])]
        if len(weight_pos) > 1 and not all(refs[id(args[p])][1].computed for p in weight_pos):
            # a weight (a view of a parameter) times a learned input computed from parameters (DETR's
            # object queries): the computed one is the layer's input
            weight_pos = [p for p in weight_pos if not refs[id(args[p])][1].computed]
        if len(weight_pos) > 1:  # a learned (1, d) token times a weight: the token is the input
            weight_pos = [p for p in weight_pos if not self._token(refs[id(args[p])][1])] or weight_pos
        if packet not in PLAIN_VIEWS and packet not in LOOKUP_INDEX:
            self._first_consumer(packet, params_in, bool(weight_pos), bool(acts_in))
        if weight_pos and fam is not None:
            self._layer(func, fam, args, weight_pos, acts_in, outs)
            weights = [args[p] for p in weight_pos]
            for a, r in params_in:  # a weight's companions (addmm's bias, a learned input): elementwise
                if not any(a is o for o in weights):
                    for j in r.params:
                        if "elementwise" not in self.uses[j]:
                            self.uses[j]["elementwise"] = Use("elementwise", str(func.overloadpacket),
                                                              self._input_detail(r, j))
            return
        if params_in and not acts_in:
            self._derived(func, args, kwargs, params_in, outs)
            return
        if packet in FUSED_RNN and params_in:
            self._fused_rnn(func, args, acts_in, outs)
            return
        if packet in LOOKUP_INDEX and id(args[0]) in refs and self._whole_matrices(packet, args):
            # experts picked by routed ids: the selected matrices are still the parameter's
            r = refs[id(args[0])][1]
            for o in outs:
                self.refs[o] = Ref(r.params, True, False, r.computed)
            return
        for _, r in params_in:  # a parameter meeting an activation in any other op
            family = "indexed" if r.indexed else "elementwise"
            detail = (self._input_detail(r, next(iter(r.params))) if operands else
                      f"normalized by {r.normed} first" if r.normed else "")
            for i in r.params:
                if family not in self.uses[i]:
                    self.uses[i][family] = Use(family, str(packet), detail)
        self._activation(func, args, kwargs, acts_in, outs)

    def _first_consumer(self, packet, params_in, layer: bool, with_act: bool) -> None:
        """Remember each parameter's first consumer when it is a normalization, or an elementwise
        op with an activation (a position table added to the tokens): such a tensor is data."""
        for _, r in params_in:
            for i in r.params:
                if i not in self.first:
                    self.first[i] = (str(packet).removeprefix("aten.") if packet in NORMALIZATIONS
                                     or (with_act and not layer) else "")

    def _fused_rnn(self, func, args, acts_in, outs) -> None:
        """A fused recurrent kernel (``_cudnn_rnn``): one layer call over its weight list, laid out
        per layer and direction as ``w_ih, w_hh[, b_ih, b_hh][, w_hr]`` (``weight_stride0`` tensors
        each); ``w_ih`` and ``w_hh`` stack the mode's gates (LSTM 4, GRU 3) as row blocks."""
        names = [a.name for a in func._schema.arguments]
        weights, stride = args[1], int(args[2])
        mode, gates = RNN_MODES.get(int(args[names.index("mode")]), ("RNN", 1))
        op = str(func.overloadpacket)
        layer = len(self.calls)
        used = []
        for k, w in enumerate(weights):
            r = self.refs.get(w)
            if r is None:
                continue
            if w.ndim < 2:
                for i in r.params:
                    self.uses[i].setdefault("elementwise", Use("elementwise", op, f"a fused {mode} kernel's bias"))
                continue
            for i in r.params:
                used.append(i)
                self.uses[i].setdefault("matmul", Use("matmul", op, f"a fused {mode} kernel's weight"))
                rows = int(w.shape[0])
                if k % stride < 2 and gates > 1 and rows % gates == 0 and len(r.params) == 1:
                    step = rows // gates
                    self.pieces.setdefault(i, set()).update((g * step, (g + 1) * step) for g in range(gates))
                    self.view_ops[i].setdefault(f"{op.removeprefix('aten.')} ({mode}: {gates} gates)", None)
        for _, a in acts_in:
            self.mark_fed(a.src)
        self.calls.append(frozenset(used))
        act = Act(frozenset((layer,)), False, None)
        for o in outs:
            self.acts[o] = act

    def _weight_like(self, r: Ref) -> bool:
        """Whether a parameter view can be a layer's weight: not normalized first, its first
        consumer not a normalization or an elementwise op, and not a parameter with fewer than two
        dims above size 1 (a learned (1, 1, d) token is an input)."""
        if r.normed or any(self.first.get(i) for i in r.params):
            return False
        return not (self._token(r) and len(self.shapes[next(iter(r.params))]) >= 3)

    def _token(self, r: Ref) -> bool:
        """A view of one parameter with fewer than two dims above size 1 (a learned token)."""
        return len(r.params) == 1 and sum(n > 1 for n in self.shapes[next(iter(r.params))]) < 2

    def _input_detail(self, r: Ref, i: int) -> str:
        """Why a parameter operand of a layer was its input rather than its weight."""
        if r.normed:
            return f"a layer's input, normalized by {r.normed} first"
        if self.first.get(i):
            return f"a layer's input: its first consumer was {self.first[i]}, not a matrix product"
        if r.computed:
            return "a layer's input computed from parameters"
        if self._token(r) and len(self.shapes[i]) >= 2:
            return f"a layer's input: a learned {'×'.join(map(str, self.shapes[i]))} token, not a matrix"
        return ""

    def _whole_matrices(self, packet, args) -> bool:
        """Whether an index op on a parameter view selects whole matrices (along the leading dim
        of a ≥ 3-D tensor: experts) rather than rows of a table."""
        x = args[0]
        if packet in (aten.index_select,):
            dim = dim_index(int(args[1]), x.ndim)
        else:
            indices = list(args[1]) if len(args) > 1 else []
            dim = next((k for k, t in enumerate(indices) if t is not None), 0)
        return x.ndim >= 3 and dim == 0

    def _layer(self, func, fam: Family, args, weight_pos, acts_in, outs) -> None:
        """A parameterized layer: record the use, mark the layers feeding it, start its output."""
        grouped = func.overloadpacket in GROUPED_MM
        layer = len(self.calls)
        for pos in weight_pos:
            r = self.refs[args[pos]]
            if grouped and args[pos].ndim == 3:
                r = r._replace(batched=True)
            detail, family = "", fam.name
            if fam.name == "grouped_conv":
                detail = f"groups={int(args[8])}"
            elif r.indexed and fam.kind == "matrix":
                family, detail = "lookup", "rows gathered by index, then multiplied"
            elif r.batched:
                detail = "through select/index (a stack of matrices)"
            elif fam.name == "lookup" and func.overloadpacket in LOOKUP_INDEX:
                detail = "rows picked by the input"
            for i in r.params:
                if family not in self.uses[i]:
                    self.uses[i][family] = Use(family, str(func.overloadpacket), detail)
                self.batched[i] |= r.batched and fam.kind == "matrix"
                if family == "matmul" and len(r.params) == 1:
                    self._matrices(i, r, func, pos, args[pos].ndim)
                if r.rows is not None and len(r.params) == 1:
                    self.pieces.setdefault(i, set()).add(r.rows[:2])
                    self.offsets[(layer, i)] = r.rows[0]
                    self.view_ops[i].setdefault(f"{r.rows[2].removeprefix('aten.')} of the weight", None)
        raw = bool(acts_in) and all(a.raw for _, a in acts_in)
        for _, a in acts_in:
            self.mark_fed(a.src)
        self.calls.append(frozenset(i for pos in weight_pos for i in self.refs[args[pos]].params))
        if raw:
            stem = fam.stem(func, args, weight_pos[0])
            for pos in weight_pos:
                for i in self.refs[args[pos]].params:
                    self.reads_input[i] = True
                    self.stems[i] = self.stems[i] or stem
        feat = None
        if outs:
            fd = fam.feature_dim(func, args, weight_pos[0])
            if fd is not None and outs[0].ndim:
                d = dim_index(fd, outs[0].ndim)
                feat = Feat(layer, d, int(outs[0].shape[d]))
        act = Act(frozenset((layer,)), False, feat)
        for o in outs:
            self.acts[o] = act

    def _matrices(self, i: int, r: Ref, func, pos: int, op_ndim: int) -> None:
        """A ≥ 3-D parameter's leading dims that a matmul treats as separate matrices."""
        shape = self.shapes[i]
        lead = 1 if r.batched and len(shape) >= 3 else leading_batch(
            r.dims, op_ndim, contracted_dim(func, pos), len(shape))
        if lead and not self.lead[i]:
            self.lead[i] = lead
            op = str(func.overloadpacket).removeprefix("aten.")
            self.view_ops[i].setdefault(f"{op} over {'×'.join(map(str, shape[:lead]))} matrices", None)

    def _derived(self, func, args, kwargs, params_in, outs) -> None:
        """An op on parameters (and constants) only: its outputs are derived from those parameters."""
        packet = func.overloadpacket
        first = params_in[0][1]
        if len(params_in) == 1 and packet in PLAIN_VIEWS:
            # t, view, transpose, split … of one parameter: the same reference, its dims followed
            i = next(iter(first.params))
            dims = view_dims(func, args, kwargs, first.dims, outs) if len(first.params) == 1 else None
            pieces = self._row_pieces(func, args, kwargs, first, i, outs)
            for k, o in enumerate(outs):
                if o not in self.refs:
                    rows = (*pieces[k], str(packet)) if pieces else first.rows
                    self.refs[o] = first._replace(dims=dims, rows=rows)
            return
        params = frozenset().union(*(r.params for _, r in params_in))
        batched = any(r.batched for _, r in params_in)
        indexed = any(r.indexed for _, r in params_in)
        if packet in SELECTS and args[0] in self.refs and len(args) > 1:
            batched = batched or (dim_index(int(args[1]), args[0].ndim) == 0 and args[0].ndim >= 3)
        elif packet in INDEX_OPS:
            whole = packet in LOOKUP_INDEX and self._whole_matrices(packet, args)
            batched, indexed = batched or whole, indexed or not whole
        computed = packet not in VIEWS or any(r.computed for _, r in params_in)
        normed = next((r.normed for _, r in params_in if r.normed), "")
        if packet in NORMALIZATIONS and args[0] in self.refs:
            normed = str(packet).removeprefix("aten.")
        ref = Ref(params, batched, indexed, computed, normed=normed)
        for o in outs:
            if o not in self.refs:
                self.refs[o] = ref

    def _row_pieces(self, func, args, kwargs, r: Ref, i: int, outs) -> Optional[list]:
        """(start, stop) of the parameter's rows in each output of a split, chunk, slice or narrow
        of a view holding all its rows in one dim (``in_proj_weight.split([E, 2E])``), else None."""
        if r.rows is not None or r.dims is None or len(r.params) != 1 or not self.shapes[i]:
            return None
        packet = func.overloadpacket
        if packet not in ROW_CUTS:
            return None
        x = args[0]
        rows = self.shapes[i][0]
        at = [d for d, held in enumerate(r.dims) if held == frozenset((0,)) and x.shape[d] == rows]
        if len(at) != 1:
            return None
        pieces: list = []
        follow(func, args, kwargs, Feat(-1, at[0], rows), outs, lambda f, a, b: pieces.append((a, b)))
        return pieces if len(pieces) == len(outs) else None

    def _activation(self, func, args, kwargs, acts_in, outs) -> None:
        """An op on activations: union of the sources, raw when every activation input is raw, and
        the features followed through views and cuts."""
        if len(acts_in) > 1:
            src = frozenset().union(*(a.src for _, a in acts_in))
            if len(src) > 4:  # a residual stream: drop the layers already known to feed another
                src = frozenset(c for c in src if c not in self.fed)
        else:
            src = acts_in[0][1].src
        raw = all(a.raw for _, a in acts_in)
        feat = None
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        head = self.acts.get(first) if first is not None else None
        if head is not None and head.feat is not None and outs and len(acts_in) == 1:
            # one activation in (a sum of two, e.g. a residual stream, mixes features: not followed)
            op = str(func.overloadpacket).removeprefix("aten.")
            feat = follow(func, args, kwargs, head.feat, outs, lambda f, a, b: self._cut(f, a, b, op))
        elif len(acts_in) == 2 and func.overloadpacket in (aten.add, aten.add_) and outs:
            feat = self._joint(acts_in, outs[0])
        if func.overloadpacket in FUSED_CELLS:
            self._gate_cuts(func, args)
        if feat is None or isinstance(feat, Feat):
            act = Act(src, raw, feat)
            for o in outs:
                self.acts[o] = act
        else:  # per-output features (a split)
            for o, f in zip(outs, feat):
                self.acts[o] = Act(src, raw, f)

    # ------------------------------------------------------------ following a layer's features

    def _joint(self, acts_in, out) -> Optional[Feat]:
        """Two layers' outputs summed feature by feature (an LSTM cell's ``W_ih·x + W_hh·h``, both
        4 gates wide): their features share one layout, and a later cut cuts both. Only layers'
        own outputs (a sum already joint, e.g. a residual stream, is not followed further)."""
        (a, fa), (b, fb) = ((t, act.feat) for t, act in acts_in)
        if fa is None or fb is None or fa.layer < 0 or fb.layer < 0 or fa.layer == fb.layer:
            return None
        if fa._replace(layer=0) != fb._replace(layer=0) or not (a.shape == b.shape == out.shape):
            return None
        self.joints.append(self.calls[fa.layer] | self.calls[fb.layer])
        return fa._replace(layer=-len(self.joints))

    def _gate_cuts(self, func, args) -> None:
        """A fused CUDA cell (``_thnn_fused_lstm_cell``) takes the input and hidden gate products
        whole and splits each into its gates inside: the cut the decomposed cell would show."""
        gates = FUSED_CELLS[func.overloadpacket]
        op = f"{str(func.overloadpacket).removeprefix('aten.')} ({gates} gates)"
        for t in args[:2]:
            act = self.acts.get(t)
            feat = act.feat if act is not None else None
            if feat is not None and not feat.k and feat.dim == t.ndim - 1 and feat.size % gates == 0:
                step = feat.size // gates
                for g in range(gates):
                    self._cut(feat, g * step, (g + 1) * step, op)

    def _cut(self, feat: Feat, start: int, stop: int, op: str = "") -> None:
        """Record that features [start, stop) of ``feat``'s layer (in units of its dim) were cut out."""
        unit = feat.size // feat.k if feat.k else 1
        weights = self.calls[feat.layer] if feat.layer >= 0 else self.joints[-1 - feat.layer]
        for i in weights:
            off = self.offsets.get((feat.layer, i), 0)
            self.pieces.setdefault(i, set()).add((off + start * unit, off + stop * unit))
            if op:
                self.view_ops[i].setdefault(op if feat.layer >= 0 else f"{op} of two layers' summed outputs", None)


__all__ = ["Tracer"]
