"""The records of role inference: a tensor's :class:`Role`, a module rule's :class:`Claim`, the role names.

Also the role a parameter's own name gives it (``bias``, :func:`own_role`), which inference from
the module tree and guessing from names share. :mod:`geomopt.compile.roles` tells the whole story.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

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


def own_role(pname: str, ndim: int) -> Optional[str]:
    """The role a parameter's own name gives it: ``bias`` (named ``bias`` or ``*_bias``, ≤ 2 dims)."""
    return "bias" if (pname == "bias" or pname.endswith("_bias")) and ndim <= 2 else None
