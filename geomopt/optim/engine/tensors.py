"""Small tensor helpers the optimizer's modules share: stacking, the working dtype, the
operators' layout (``layout: in_out``), sharded (DTensor) data, flat buffers."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from geomopt.compile.plan import ParamPlan
from geomopt.distributed.executors import is_dtensor
from geomopt.geometry.matrix import split_like

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from geomopt.distributed.layout import Layout


def count_tensor(n) -> torch.Tensor:
    """A per-parameter step count (Adam's ``adam_step``, the post-stages' ``post_step``) as the
    state keeps it: a 0-dim int64 tensor on the CPU. A tensor, as torch's optimizers keep
    ``step`` (tools that compare or move optimizer state expect tensors); int64, so it is exact
    at any count (float32 rounds counts past 2²⁴); on the CPU, so reading it for the host's bias
    corrections never waits on a device. A capturable step keeps it on the device instead
    (:func:`geomopt.optim.engine.capturable.counts_on_device`)."""
    return torch.tensor(int(n), dtype=torch.int64)


def stack(tensors: list) -> torch.Tensor:
    """Stack along a new leading dim; one tensor becomes a view (no copy)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (bf16 gradients and state in float32; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def op_view(t: torch.Tensor, pp: ParamPlan) -> torch.Tensor:
    """The tensor as the operators see it (transposed for ``layout: in_out``)."""
    return t.transpose(0, 1) if pp.transpose else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return cast("DTensor", t).to_local() if is_dtensor(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor is all-gathered: every rank must call this)."""
    return cast("DTensor", t).full_tensor() if is_dtensor(t) else t


def op_layout(layout: "Layout", pp: ParamPlan) -> "Layout":
    """A sharded tensor's layout as the operators see it (transposed for ``layout: in_out``)."""
    return layout.transposed() if pp.transpose else layout


#: parameter dtypes the flat path steps in their own precision (complex ones through real views)
FLAT_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as a real view with a trailing dim of 2 (re, im: ``torch.view_as_real``,
    no copy); a real tensor as it is. The flat path steps complex parameters, their gradients and
    state through these views, as torch.optim's optimizers do."""
    return torch.view_as_real(t) if t.is_complex() else t


def like_param(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`as_real` for a state entry of parameter ``p``: complex where ``p`` is."""
    return torch.view_as_complex(v) if p.is_complex() and not v.is_complex() else v


def flat_like(xs: list) -> tuple:
    """An empty flat buffer holding every tensor of ``xs``, and its views shaped like them."""
    buf = torch.empty(sum(x.numel() for x in xs), dtype=xs[0].dtype, device=xs[0].device)
    return buf, split_like(buf, xs)


def in_set(x: torch.Tensor, xp: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether x is in the set that ``xp`` = P_C(x) projects onto, up to rounding: ‖xp − x‖_F ≤
    (64u + 2u_dtype)·‖x‖_F, u the working precision (what re-projecting a point of the set moves it
    by: an SVD or eigh reconstruction) and u_dtype the parameter's (a point of the set rounded to
    bf16)."""
    slack = 64 * torch.finfo(x.dtype).eps + 2 * torch.finfo(dtype).eps
    return bool(torch.linalg.vector_norm(xp - x) <= slack * torch.linalg.vector_norm(x))

