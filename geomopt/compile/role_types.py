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
