"""Adam(W), written once per form: :func:`adam_moments` on one (stacked) tensor, shared by the
``adam`` forward op and the optimizer's batched path (torch.optim.AdamW's single-tensor op order),
and :func:`adam_multi_tensor` on lists of tensors (torch's fused AdamW kernel, or foreach ops in
the same op order), the optimizer's flat path."""

from __future__ import annotations

from typing import cast

import torch

from geomopt.geometry.matrix import split_like, working_dtype
from geomopt.geometry.reference import working_eps
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.spec.geometries import Adam


def adam_hyper(geometry: ResolvedGeometry) -> tuple[float, float, float]:
    """(β₁, β₂, ε) of an adam geometry (its spec model holds every default)."""
    spec = cast(Adam, geometry.spec)
    beta1, beta2 = spec.betas
    return float(beta1), float(beta2), float(spec.eps)


def adam_moments(g: torch.Tensor, state: dict, geometry: ResolvedGeometry) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Update m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g² in ``state`` (float32 at least) and return
    (m, √v/√bc₂ + ε, bc₁) with bc_i = 1 − β_i^t, in torch.optim.AdamW's single-tensor op order, so
    ``x.addcdiv(m, denom, value=-lr/bc₁)`` is AdamW's step bit for bit. ε is floored at √tiny of the
    state's dtype (:func:`geomopt.geometry.reference.working_eps`: √v loses gradients below √tiny,
    whose squares underflow, and a smaller ε would divide m by ~0 there; +∞ past the dtype's range),
    which changes nothing for ε ≥ √tiny (1.1e-19 in float32)."""
    beta1, beta2, eps = adam_hyper(geometry)
    if "exp_avg" not in state:
        state["adam_step"] = 0
        dtype = working_dtype(g.dtype)
        state["exp_avg"] = torch.zeros_like(g, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(g, dtype=dtype, memory_format=torch.preserve_format)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    # a Python int (the optimizer reads its CPU count tensor: no device sync for the bias
    # corrections), or a 0-dim device tensor in a capturable step;
    # a new value, not an increment in place: a bucket's tensors share it
    step = state["adam_step"] = state["adam_step"] + 1
    if isinstance(step, torch.Tensor):  # 1 − βᵗ in float64, as the host computes it (float32 loses ~1e-4)
        step = step.to(torch.float64)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(working_eps(eps, exp_avg_sq.dtype, norm=True))
    return exp_avg, denom, bias_correction1


def adam_multi_tensor(xs, us, m, v, step, pieces, off, geometry, gamma, weight_decay, fused, take,
                      steps=None, found_inf=None) -> None:
    """AdamW's update of ``xs`` (a block's ``pieces`` of the flat call, from ``off`` in the
    flat moments ``m``, ``v``, each a (buffer, views) pair; all of it when ``pieces`` is None):
    torch's fused AdamW kernel where ``fused`` (the caller checked the device has it:
    :mod:`geomopt.optim.engine.program`) (torch.optim.AdamW(fused=True) bit for bit: one pass
    instead of eight), else :func:`adam_moments`'s op order (AdamW's
    single-tensor path, bit for bit) with the denominator in ``take("denom", shape)`` (a scratch).
    ``steps``: the fused kernel's count as a float32 0-d tensor, made by the caller before it writes
    anything (None: made here); ``found_inf`` (fused only): a float32 0-d device tensor, 1 where the
    step is skipped (the kernel then returns before any write; ``gamma`` may be a 0-d tensor)."""
    beta1, beta2, eps = adam_hyper(geometry)
    (m, m_views), (v, v_views) = m, v
    eps = working_eps(eps, v.dtype, norm=True)
    if pieces is not None:
        n = sum(x.numel() for x in xs)
        m, v = m[off:off + n], v[off:off + n]
        m_views, v_views = split_like(m, xs), split_like(v, xs)
    if fused:
        if steps is None:
            steps = torch.full((), step, dtype=torch.float32, device=xs[0].device)
        # the count is read, not written
        torch._fused_adamw_(xs, us, m_views, v_views, [], [steps] * len(xs), lr=gamma, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=found_inf)
        return
    torch._foreach_lerp_(m_views, us, 1 - beta1)
    v.mul_(beta2)
    torch._foreach_addcmul_(v_views, us, us, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = take("denom", v.shape)
    torch.sqrt(v, out=denom).div_(bias_correction2_sqrt).add_(eps)
    if weight_decay:
        torch._foreach_mul_(xs, 1 - gamma * weight_decay)
    torch._foreach_addcdiv_(xs, m_views, split_like(denom, xs), value=-gamma / bias_correction1)
