"""A batched bucket's write-back arithmetic on its stacked step: Y = X(1 − γλ) + c·S formed from
the parameters' rows (:func:`axpy_rows`) or in place on a stacked Y (:func:`axpy_`), for the
prox of a constraint to map before it is copied back (:mod:`geomopt.optim.engine.bucket_step`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def axpy_(y: torch.Tensor, step: torch.Tensor, coef) -> torch.Tensor:
    """Y += c·S in place: ``add_``'s alpha for a number, a product for a 0-d tensor c (lr on the
    device, where ``alpha`` takes no tensor)."""
    return y.add_(step * coef) if torch.is_tensor(coef) else y.add_(step, alpha=coef)


def axpy_rows(views: list, step: torch.Tensor, decay: Optional[Callable], factor: float, coef: float) -> torch.Tensor:
    """Y = decay(X) + c·S (``decay`` None: X + c·S; else a decay's ``into`` form with ``factor``
    = 1 − γλ) with X read from the parameters' rows into Y, not stacked first: one pass over X
    fewer than ``axpy_(decay.stacked(stack(X), …))`` and ``torch.add(stack(X), S, alpha=c)``, with
    the same elementwise ops, so the same bits."""
    y = torch.empty_like(step)
    if decay is None:
        for v, s, out in zip(views, step.unbind(0), y.unbind(0)):
            torch.add(v, s, alpha=coef, out=out)
        return y
    for v, out in zip(views, y.unbind(0)):
        decay(v, factor, out)
    return y.add_(step, alpha=coef)

