"""What torch users expect of any ``torch.optim.Optimizer`` (the contract PyTorch's generic optimizer
tests check: ``torch.testing._internal.common_optimizers``), where a geomopt spec needs a word of
translation. :class:`~geomopt.optim.GeomOptimizer`'s constructor and step call these:

* ``lr=`` / ``weight_decay=`` keywords (:func:`with_overrides`): they replace the spec's
  ``defaults:`` value, so every rule that does not set its own follows them; a rule that sets one
  keeps it (it was written for that rule: Adam's lr beside Muon's is not the same number).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Optional

from geomopt.spec.model import Spec


def _checked(name: str, value, *, positive: bool) -> float:
    """``value`` as a float, or a clear error naming the keyword."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"GeomOptimizer's {name}= must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"GeomOptimizer's {name}= must be finite, not {value}")
    if positive and value <= 0:
        raise ValueError(f"GeomOptimizer's {name}= must be > 0, not {value} (to freeze tensors, leave them out "
                         f"of the optimizer or give them requires_grad=False)")
    if value < 0:
        raise ValueError(f"GeomOptimizer's {name}= must be >= 0, not {value}")
    return value


def with_overrides(spec: Spec, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> Spec:
    """``spec`` with ``lr`` / ``weight_decay`` (where given) as its ``defaults:`` values.

    Folded into the spec rather than into the param groups, so the spec the optimizer holds says
    what runs: ``geomopt explain``-style dumps, the checkpoint's spec text and hash, and a load
    under other overrides (a spec change: refused unless ``allow_spec_change=True``, after which
    the new values win, as for an edited spec file) all agree with the groups' values."""
    values = {}
    if lr is not None:
        values["lr"] = _checked("lr", lr, positive=True)
    if weight_decay is not None:
        values["weight_decay"] = _checked("weight_decay", weight_decay, positive=False)
    if not values:
        return spec
    # model_copy keeps the source positions (warnings point at the spec's lines) and skips
    # validation, which _checked did for these two values
    return spec.model_copy(update={"defaults": spec.defaults.model_copy(update=values)})
