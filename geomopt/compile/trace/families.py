"""Op families: how a traced forward consumes a parameter, one registered unit per family.

The tracer (:mod:`geomopt.compile.trace`) sees every aten op of one forward. An op that reads a
parameter (or a view of one) belongs to one family below; the family says which arguments are
*operands* (a matrix factor, a convolution kernel, a lookup table) and, for the ops that make a
layer's output, which dim of that output indexes the weight's output features and whether reading
the model's raw input makes the layer a *stem*. Every other op that reads a parameter together
with an activation is ``elementwise`` (a norm's scale, a bias, a gate, ``exp(A_log) · x``).

A family's docstring is its documentation (``geomopt rule roles`` prints them): what it matches
and the role its operands take.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Family:
    """A registered op family: ``operands(func, args)`` gives the argument positions that read a
    weight as an operand (empty when the op does not use it as one); ``kind`` is what its use
    makes of the weight."""

    name: str
    kind: str  # "matrix" (a matrix role), "lookup" (embedding), "other" (never a matrix role)
    doc: str
    operands: Callable[[object, tuple], tuple[int, ...]]
    feature_dim: Callable[[object, tuple, int], Optional[int]]  # output dim of the weight's outputs
    stem: Callable[[object, tuple, int], Optional[str]]  # the stem kind when the input is raw


FAMILIES: dict[str, Family] = {}
_BY_OP: dict[object, Family] = {}


def _none(*_):
    return None


def op_family(name: str, kind: str, ops: tuple, *, feature_dim=_none, stem=_none):
    """Register ``fn(func, args) -> operand positions`` as family ``name`` for the aten ``ops``
    (overload packets); its docstring documents the family."""

    def register(fn):
        fam = Family(name, kind, " ".join((fn.__doc__ or "").split()), fn, feature_dim, stem)
        FAMILIES[name] = fam
        for op in ops:
            _BY_OP[op] = fam
        return fn

    return register


def family_of(func) -> Optional[Family]:
    """The family of an aten op (an ``OpOverload``), or None for an op no family claims."""
    return _BY_OP.get(func.overloadpacket)


_MATMUL_OPERANDS = {aten.addmm: (1, 2), aten.baddbmm: (1, 2), aten.addbmm: (1, 2), aten.addmv: (1, 2),
                    aten._addmm_activation: (1, 2), aten.linear: (1,)}


def _matmul_feature_dim(func, args, pos: int) -> Optional[int]:
    """A weight as the right factor (x·W, x·Wᵀ) makes the output's last dim; as the left factor
    (W·x) its rows."""
    packet = func.overloadpacket
    if packet is aten.linear:
        return -1
    first = _MATMUL_OPERANDS.get(packet, (0, 1))[0]
    return -1 if pos != first else (-2 if packet not in (aten.mv, aten.addmv) else -1)


def contracted_dim(func, pos: int) -> int:
    """The dim a matmul contracts of its operand at ``pos``: a right factor's rows (x·W: -2), a left
    factor's columns (W·x: -1)."""
    first = _MATMUL_OPERANDS.get(func.overloadpacket, (0, 1))[0]
    return -2 if pos != first else -1


GROUPED_MM = frozenset(op for op in (getattr(aten, "_grouped_mm", None), getattr(aten, "_scaled_grouped_mm", None))
                       if op is not None)


@op_family("matmul", "matrix", (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv,
                                aten._addmm_activation, aten.linear, aten.matmul, *GROUPED_MM),
           feature_dim=_matmul_feature_dim)
def _matmul(func, args) -> tuple[int, ...]:
    """``matmul``: a factor of ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``mv`` (what ``nn.Linear``,
    ``F.linear``, ``@`` and ``einsum`` reach the dispatcher as) or ``_grouped_mm`` (a stack of
    experts' matrices, one per group of tokens); the additive term of ``addmm`` is
    not an operand (a bias). A matrix of the body is ``hidden`` (``expert`` inside an experts
    container, ``router`` beside one); a layer whose output reaches the model's outputs with no
    parameterized layer after it is a ``head``. A tensor normalized first, or first met elementwise
    with the activations, and a (1, 1, d) token are the layer's input, not its weight."""
    return _MATMUL_OPERANDS.get(func.overloadpacket, (0, 1))


def _conv_groups(args) -> int:
    return int(args[8]) if len(args) > 8 else 1


def _conv_stem(func, args, pos: int) -> Optional[str]:
    """A convolution over the raw input is a stem when it patchifies (stride = kernel, no padding:
    ViT, CLIP, Swin, ConvNeXt, Qwen2-VL's Conv3d) or runs along time (a 1-D kernel over audio
    frames: Whisper, wav2vec2); a 2-D kernel sliding over pixels (ResNet's first conv) is not."""
    weight = args[1]
    kernel = tuple(weight.shape[2:])
    if len(kernel) == 1:
        return "audio"
    stride, padding = tuple(args[3]), tuple(args[4])
    stride = stride * len(kernel) if len(stride) == 1 else stride
    if stride == kernel and all(int(p) == 0 for p in padding):
        return "patch"
    return None


@op_family("conv", "matrix", (aten.convolution, aten._convolution), feature_dim=lambda f, a, p: 1, stem=_conv_stem)
def _conv(func, args) -> tuple[int, ...]:
    """``conv``: the kernel of a full convolution (``groups = 1``; ``nn.Conv1d/2d/3d`` and their
    transposes): a matrix of the body (out × in·k…), or an ``embedding`` when it is a stem that
    reads the model's raw input (patches, audio frames)."""
    return (1,) if _conv_groups(args) == 1 else ()


@op_family("grouped_conv", "other", ())
def _grouped_conv(func, args) -> tuple[int, ...]:
    """``grouped_conv``: the kernel of a grouped or depthwise convolution (``groups > 1``: Mamba's
    and hybrid models' short convolutions, ConvNeXt's 7×7 depthwise): per-channel filters, never a
    matrix role (``other``)."""
    return (1,) if _conv_groups(args) > 1 else ()


def conv_family(args) -> Family:
    """``conv`` or ``grouped_conv`` for a convolution's arguments."""
    return FAMILIES["conv" if _conv_groups(args) == 1 else "grouped_conv"]


@op_family("lookup", "lookup", (aten.embedding, aten.embedding_bag, aten._embedding_bag),
           feature_dim=lambda f, a, p: -1, stem=lambda f, a, p: "token")
def _lookup(func, args) -> tuple[int, ...]:
    """``lookup``: the table of ``embedding`` / ``embedding_bag`` (``nn.Embedding``, T5's relative
    attention buckets), a 2-D table whose rows ``index`` picks by the input (``table[ids]``), and
    rows gathered by ``index`` that a matmul then multiplies (ViTDet's and SAM's decomposed
    relative-position tables, also when interpolated first): ``embedding``."""
    return (0,)


INDEX_OPS = frozenset({aten.index, aten.index_select, aten.gather, aten.take, aten.take_along_dim,
                       aten._unsafe_index, aten.embedding_dense_backward})


# normalizations: a parameter they read first is normalized data (a position table), not a weight
NORMALIZATIONS = frozenset(op for op in (
    aten.native_layer_norm, aten.layer_norm, aten.native_group_norm, aten.group_norm, aten.native_batch_norm,
    aten.batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional, getattr(aten, "rms_norm", None), getattr(aten, "_fused_rms_norm", None))
    if op is not None)


@op_family("indexed", "other", ())
def _indexed(func, args) -> tuple[int, ...]:
    """``indexed``: a table read by ``index``, ``index_select``, ``gather`` (Swin's
    ``relative_position_bias_table[index]``) whose rows then only enter elementwise ops: ``other``.
    (Whole matrices of a ≥ 3-D tensor selected along its leading dim — an expert stack indexed by
    expert — are ``matmul`` operands; rows of a table then multiplied are a ``lookup``.)"""
    return ()


@op_family("elementwise", "other", ())
def _elementwise(func, args) -> tuple[int, ...]:
    """``elementwise``: every other op that reads a parameter with an activation (``mul``, ``add``,
    ``exp``, a norm's scale, a concatenated class token): ``other``, or the norm, bias or
    embedding role the module tree gives it (an elementwise use agrees with those)."""
    return ()


def family_docs() -> str:
    """The families, for ``geomopt rule roles``."""
    return "\n".join(f"  {f.doc}" for f in FAMILIES.values())
