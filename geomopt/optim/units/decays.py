"""Weight decays, each a declared unit: X ← X·(1 − γλ) after the step's other parts and before the
constraint (one step is direction → geometry → post-stages → weight decay → constraint).

A :class:`DecayUnit` says, once: its spec model (:data:`geomopt.spec.updates.Decay`), its
arithmetic on a bucket's stacked copy of X (``stacked(x, step, factor) -> X'``, a new tensor, with
S the step it goes with and ``factor`` = 1 − γλ), its arithmetic in place on a list of tensors
where it has one (``in_place(xs, factor)``: the flat path's and the in-place write-backs' form) and
into a given output (``into(x, factor, out)``: a stacked write-back's rows read from the parameters),
and whether it reads the step S — a decay that does cannot run before the step is known, so it
has no in-place form and its bucket writes X from the stacked copy
(:mod:`geomopt.optim.engine.program` reads that here, not from the decay's name).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from geomopt.registry import LOCAL, Registry
from geomopt.spec.updates import CautiousDecay, DecoupledDecay


@dataclasses.dataclass(frozen=True)
class DecayUnit:
    """A weight decay: ``stacked(x, step, factor)`` (every decay), ``in_place(xs, factor)`` and
    ``into(x, factor, out)`` (None: it has none), ``reads_step`` (it reads S, so the step comes
    first), ``locality`` (where it can run on a shard: both decays act entry by entry), ``scales``
    (it is X·factor and nothing else, which a matrix product's β applies as it accumulates into X:
    :func:`geomopt.optim.engine.fused.write_product`)."""

    name: str
    spec: Any
    stacked: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
    in_place: Optional[Callable[[list, Any], None]] = None
    into: Optional[Callable[[torch.Tensor, Any, torch.Tensor], None]] = None
    reads_step: bool = False
    locality: str = LOCAL
    scales: bool = False

    def __post_init__(self):
        if self.reads_step and (self.in_place is not None or self.into is not None):
            raise ValueError(f"decay {self.name!r} reads the step, so it has no in-place form before it")

    def why_not_in_place(self) -> Optional[str]:
        """Why the decay cannot run on the tensors in place (a flat call, an in-place write-back)."""
        if self.reads_step:
            return f"{self.name} weight decay reads the update's sign per entry"
        return None if self.in_place is not None else f"{self.name} weight decay has no in-place form"


DECAYS = Registry("decay")


def decay(unit: DecayUnit) -> DecayUnit:
    """Register a decay under its name (one per kind of the spec's ``decay``)."""
    DECAYS.add(unit.name, unit)
    return unit


def _decoupled_stacked(x: torch.Tensor, step: torch.Tensor, factor) -> torch.Tensor:
    """X·(1 − γλ) (AdamW's decoupled decay, torch's form)."""
    return x * factor


def _decoupled_in_place(xs: list, factor) -> None:
    """X ← X·(1 − γλ) for each X of the list, in place (one foreach kernel)."""
    torch._foreach_mul_(xs, factor)


def _decoupled_into(x: torch.Tensor, factor, out: torch.Tensor) -> None:
    """out ← X·(1 − γλ) (a row of a stacked result, written from the parameter itself)."""
    torch.mul(x, factor, out=out)


def _cautious_stacked(x: torch.Tensor, step: torch.Tensor, factor) -> torch.Tensor:
    """X·(1 − γλ) only where the step S and X agree in sign (S⊙X ≥ 0), X elsewhere (Chen et al.
    2025, cautious weight decay)."""
    return torch.where(step * x >= 0, x * factor, x)


decay(DecayUnit("decoupled", DecoupledDecay, _decoupled_stacked, _decoupled_in_place, _decoupled_into, scales=True))
decay(DecayUnit("cautious", CautiousDecay, _cautious_stacked, reads_step=True))
