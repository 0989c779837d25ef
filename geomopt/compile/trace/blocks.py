"""Views from use: where a layer's output features go through the traced forward, and the blocks
its cuts make.

A parameterized layer's output holds its weight's output features along one dim. Views, transposes,
permutes and pointwise ops carry them to a new dim (:class:`Feat`); a reshape may split them into
``k`` equal chunks with the chunk index leading (``view(…, 3, n/3)``: q, k, v of
``nn.MultiheadAttention``; but ``view(…, heads, 3, d)`` interleaves q, k, v per head and is not a cut
into row blocks); ``split``, ``chunk``, slices, ``unbind``, ``select`` and ``glu`` along them cut
pieces. Pieces that tile the features into two or more make the weight's output blocks
(:func:`blocks`): a fused q, k, v or gate, up projection, found from what the forward does with it.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

aten = torch.ops.aten

_SPLITS = frozenset({aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk, aten.unbind,
                     aten.split_copy, aten.split_with_sizes_copy, aten.unbind_copy})
_UNBINDS = frozenset({aten.unbind, aten.unbind_copy})
_RESHAPES = frozenset({aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.view_copy,
                       aten.unflatten, aten.flatten})
_SAME_DIMS = frozenset({aten.clone, aten._to_copy, aten.contiguous, aten.alias, aten.detach, aten.expand,
                        aten.lift_fresh, aten.resolve_conj, aten.resolve_neg, aten.native_dropout,
                        aten.dropout, aten.detach_copy, aten.alias_copy})


class Feat(NamedTuple):
    """Where a layer's output features sit in an activation: dim ``dim`` holds all of them
    (``k`` = 0), or dim ``dim`` indexes ``k`` equal chunks of them (after ``view(…, k, n/k)``)."""

    layer: int
    dim: int
    size: int  # the layer's number of output features
    k: int = 0

    def at(self, dim: int) -> "Feat":
        """The same features at another dim."""
        return Feat(self.layer, dim, self.size, self.k)


def dim_index(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def follow(func, args, kwargs, feat: Feat, outs, cut: Callable[[Feat, int, int], None]):
    """Where ``feat`` sits in the output of op ``func`` on an activation holding it: a new
    :class:`Feat`, a list of them (one per output of ``unbind``), or None (lost, or cut: ``cut``
    records the pieces)."""
    packet = func.overloadpacket
    x = args[0]
    nd = x.ndim
    length = feat.k or feat.size
    if packet in _SPLITS:
        unbind = packet in _UNBINDS
        pos = 1 if unbind else 2  # unbind(x, dim); split(x, sizes, dim)
        dim = dim_index(int(args[pos] if len(args) > pos else kwargs.get("dim", 0)), nd)
        if dim != feat.dim:
            return [feat.at(feat.dim - (1 if dim < feat.dim else 0)) for _ in outs] if unbind else feat
        start = 0
        for o in outs:
            size = 1 if unbind else int(o.shape[dim])
            cut(feat, start, start + size)
            start += size
        return None
    if packet in (aten.slice, aten.slice_copy, aten.narrow):
        dim = dim_index(int(args[1]) if len(args) > 1 else 0, nd)
        if dim != feat.dim:
            return feat
        if packet is aten.narrow:
            start, stop = int(args[2]), int(args[2]) + int(args[3])
        else:
            start = int(args[2]) if len(args) > 2 and args[2] is not None else 0
            stop = int(args[3]) if len(args) > 3 and args[3] is not None else length
            step = int(args[4]) if len(args) > 4 else 1
            if step != 1:
                return None
            start, stop = max(0, start + length if start < 0 else start), min(length, stop + length
                                                                                if stop < 0 else stop)
        if (start, stop) != (0, length):
            cut(feat, start, stop)
            return None
        return feat
    if packet in (aten.select, aten.select_copy):
        dim = dim_index(int(args[1]), nd)
        if dim == feat.dim:
            i = int(args[2])
            i = i + length if i < 0 else i
            if feat.k:
                cut(feat, i, i + 1)
            return None
        return feat.at(feat.dim - (1 if dim < feat.dim else 0))
    if packet is aten.glu and dim_index(int(args[1]) if len(args) > 1 else -1, nd) == feat.dim and not feat.k:
        cut(feat, 0, feat.size // 2)
        cut(feat, feat.size // 2, feat.size)
        return None
    out = outs[0]
    if packet in _SAME_DIMS:
        return feat if out.ndim == nd else None
    if packet in (aten.t, aten.transpose, aten.transpose_copy, aten.t_copy):
        a, b = (0, 1) if packet in (aten.t, aten.t_copy) else (dim_index(int(args[1]), nd), dim_index(int(args[2]), nd))
        d = b if feat.dim == a else a if feat.dim == b else feat.dim
        return feat.at(d)
    if packet in (aten.permute, aten.permute_copy):
        order = [dim_index(int(d), nd) for d in args[1]]
        return feat.at(order.index(feat.dim))
    if packet in (aten.unsqueeze, aten.unsqueeze_copy):
        d = dim_index(int(args[1]), nd + 1)
        return feat.at(feat.dim + (1 if d <= feat.dim else 0))
    if packet in (aten.squeeze, aten.squeeze_copy):
        if out.ndim == nd:
            return feat
        dims = args[1] if len(args) > 1 else None
        dims = [dims] if isinstance(dims, int) else list(dims) if dims is not None else list(range(nd))
        gone = [i for i in (dim_index(int(d), nd) for d in dims) if x.shape[i] == 1]
        if feat.dim in gone:
            return None
        return feat.at(feat.dim - sum(g < feat.dim for g in gone))
    if packet in _RESHAPES:
        return _reshape(feat, tuple(x.shape), tuple(out.shape))
    if torch.Tag.pointwise in func.tags and tuple(out.shape) == tuple(x.shape):
        return feat
    return None


def _reshape(feat: Feat, before: tuple, after: tuple) -> Optional[Feat]:
    """Where the features go through a reshape: kept whole at a new dim, or split into (k, n/k)
    with k leading; anything else loses them."""
    d = feat.dim
    lead, size, trail = math.prod(before[:d]), before[d], math.prod(before[d + 1:])
    acc = 1
    for j in range(len(after) + 1):
        if acc == lead:
            break
        if j == len(after) or acc > lead:
            return None
        acc *= after[j]
    else:
        return None
    while j < len(after) and after[j] == 1 and size != 1:
        j += 1  # size-1 dims before the features belong to the leading dims
    # dims j … m of ``after`` hold the features (their product is ``size``) with ``trail`` after them
    acc, m = 1, j
    while m < len(after) and acc < size:
        acc *= after[m]
        m += 1
    if acc != size or math.prod(after[m:]) != trail:
        return None
    if feat.k:
        return feat.at(j) if m - j >= 1 and after[j] == feat.k else None
    if m - j == 1:
        return feat.at(j)
    return Feat(feat.layer, j, feat.size, int(after[j]))


def blocks(pieces: Optional[set]) -> Optional[list[int]]:
    """Block sizes when the cuts of a layer's output cover its features from 0 with no gap: the
    finest partition their ends make (a fused ``[q | kv]`` split whose ``kv`` part is cut again gives
    q, k, v), when it has ≥ 2 blocks."""
    if not pieces:
        return None
    ordered = sorted(pieces)
    reach = 0
    for start, stop in ordered:
        if start > reach:
            return None  # a gap: the cuts do not cover the features
        reach = max(reach, stop)
    ends = sorted({e for piece in ordered for e in piece})
    if ends[0] != 0 or len(ends) < 3:
        return None
    return [b - a for a, b in zip(ends, ends[1:])]


# ---------------------------------------------------------------- a parameter's own dims through its views


def view_dims(func, args, kwargs, dims: Optional[tuple], outs) -> Optional[tuple]:
    """Where a parameter's dims go through a view-like op: ``dims[j]`` is the set of the
    parameter's dims that dim ``j`` of the view holds (merged by a reshape, none for a new size-1
    dim); the same for the op's first output (a split's outputs keep the dims, ``unbind`` and
    ``select`` drop one), or None where the op loses track."""
    if dims is None or not outs:
        return None
    packet = func.overloadpacket
    x, out = args[0], outs[0]
    nd = x.ndim
    if packet in _UNBINDS or packet in (aten.select, aten.select_copy):
        d = dim_index(int(args[1]) if len(args) > 1 else int(kwargs.get("dim", 0)), nd)
        return dims[:d] + dims[d + 1:]
    if out.ndim == nd and (packet in _SPLITS or packet in _SAME_DIMS or packet in (
            aten.slice, aten.slice_copy, aten.narrow, aten.repeat)):
        return dims
    if packet is aten.expand:
        return (frozenset(),) * (out.ndim - nd) + dims
    if packet in (aten.t, aten.transpose, aten.transpose_copy, aten.t_copy, aten.permute, aten.permute_copy):
        if packet in (aten.permute, aten.permute_copy):
            order = [dim_index(int(d), nd) for d in args[1]]
        else:
            a, b = (0, 1) if packet in (aten.t, aten.t_copy) or nd < 2 else (
                dim_index(int(args[1]), nd), dim_index(int(args[2]), nd))
            order = list(range(nd))
            if nd >= 2:
                order[a], order[b] = order[b], order[a]
        return tuple(dims[j] for j in order)
    if packet in _RESHAPES or packet in (aten.unsqueeze, aten.squeeze, aten.unsqueeze_copy, aten.squeeze_copy):
        return _regroup(dims, tuple(x.shape), tuple(out.shape))
    return None


def _regroup(dims: tuple, before: tuple, after: tuple) -> Optional[tuple]:
    """``dims`` through a reshape from ``before`` to ``after``: each run of dims whose sizes
    multiply to the same product maps onto the other (size-1 dims hold no parameter dim)."""
    bi = [k for k, n in enumerate(before) if n != 1]
    ai = [k for k, n in enumerate(after) if n != 1]
    out: list[frozenset] = [frozenset()] * len(after)
    p = q = 0
    while p < len(bi) and q < len(ai):
        gb, ga = [bi[p]], [ai[q]]
        sb, sa = before[bi[p]], after[ai[q]]
        p, q = p + 1, q + 1
        while sb != sa:
            if sb < sa and p < len(bi):
                gb.append(bi[p])
                sb, p = sb * before[bi[p]], p + 1
            elif sa < sb and q < len(ai):
                ga.append(ai[q])
                sa, q = sa * after[ai[q]], q + 1
            else:
                return None
        merged = frozenset().union(*(dims[k] for k in gb))
        for k in ga:
            out[k] = merged
    return tuple(out) if p == len(bi) and q == len(ai) else None


def leading_batch(dims: Optional[tuple], op_ndim: int, contracted: int, ndim: int) -> int:
    """How many leading dims of a parameter (``ndim`` ≥ 3) index separate matrices in a matmul
    whose operand holds its dims as ``dims`` and contracts operand dim ``contracted`` (-1 or -2):
    a leading dim in the operand's batch dims (``bmm``), or merged into its output features ahead
    of another output dim (``einsum('bnd,hde->bhne')`` multiplies by ``(d, h·e)``: one d × e matrix
    per h), and not contracted."""
    if dims is None or ndim < 3 or len(dims) != op_ndim or op_ndim < 2:
        return 0
    c = dims[contracted]
    f = dims[-1 if contracted == -2 else -2]
    batch = frozenset().union(*dims[:op_ndim - 2])
    lead = 0
    for j in range(ndim - 2):
        if j in c or not (j in batch or (j in f and any(k > j and k not in c for k in f))):
            break
        lead += 1
    return lead


__all__ = ["Feat", "blocks", "follow", "leading_batch", "view_dims"]
