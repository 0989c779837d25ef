"""The records of role inference: a tensor's :class:`Role`, a module rule's :class:`Claim`, the role names.

Also the role a parameter's own name gives it (``bias``, :func:`own_role`) and what keeps a tensor
of ≥ 2 dims from being a matrix (:func:`not_a_matrix`), which inference from the module tree and
guessing from names share. :mod:`geomopt.compile.roles` tells the whole story.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

# what to do about roles decided without a trace (the optimizer's warning, plan, explain, init)
TRACE_FIX = ("pass example_inputs= (one forward's inputs; a --model factory returns (model, inputs)) or pin the "
             "roles with the spec's roles: (roles= in Python)")

ROLES = ("embedding", "head", "router", "expert", "norm", "bias", "hidden", "other")


@dataclasses.dataclass(frozen=True)
class Role:
    """The role(s) of one tensor and why."""

    roles: tuple[str, ...]
    evidence: str
    guessed: bool = False
    structure: Optional[dict] = None
    # how the role was decided: "trace" (what the tensor does in a traced forward), "module tree"
    # (the model's structure, no trace), "names" (a guess from names and shapes)
    basis: str = "module tree"
    inferred: Optional[str] = None  # the module tree's role and evidence where the trace overrode it
    untraced: Optional[str] = None  # why no trace decided it (basis "module tree")

    @property
    def name(self) -> str:
        return "+".join(self.roles)


@dataclasses.dataclass(frozen=True)
class Claim:
    role: str
    evidence: str
    structure: Optional[dict] = None


_RNN_BIAS = re.compile(r"bias_(ih|hh)_l\d+(_reverse)?")


def own_role(pname: str, ndim: int) -> Optional[str]:
    """The role a parameter's own name gives it: ``bias`` (named ``bias``, ``*_bias``, or an RNN's
    ``bias_ih_l0`` / ``bias_hh_l1_reverse``; ≤ 2 dims)."""
    named = pname == "bias" or pname.endswith("_bias") or _RNN_BIAS.fullmatch(pname) is not None
    return "bias" if named and ndim <= 2 else None


def not_a_matrix(shape: tuple, module: Any = None) -> Optional[str]:
    """Why a tensor of ≥ 2 dims is no matrix, or None: the kernel of a grouped convolution (its
    owning ``module`` has ``groups > 1``: a depthwise kernel (C, 1, k, k) is C separate filters,
    not one C × k² operator), or a single row or column (its matrix (shape[0], ∏ shape[1:]) has a
    side 1: a vector, whose polar factor is itself normalized)."""
    groups = getattr(module, "groups", 1)
    if len(shape) >= 3 and isinstance(groups, int) and groups > 1:
        return f"a grouped convolution's kernel ({type(module).__name__}, groups={groups})"
    rows, cols = shape[0], math.prod(shape[1:])
    if rows == 1 or cols == 1:
        return f"a single {'row' if rows == 1 else 'column'} ({'×'.join(map(str, shape))}): a vector"
    return None
