"""Which rule owns each tensor: every rule's matches, run rule by rule over all tensors, the first
match winning. The compiler plans from it, and lint's :class:`~geomopt.lint.context.LintContext`
is one (with what lint alone reads).
"""

from __future__ import annotations

import dataclasses

from geomopt.compile.match import Matcher, ParamInfo
from geomopt.compile.roles.assign import ensure_roles
from geomopt.spec.model import Spec


@dataclasses.dataclass
class Ownership:
    spec: Spec
    params: list[ParamInfo]  # trainable tensors, ties collapsed
    frozen: list[ParamInfo]
    owner: dict[str, int | None]  # parameter name → index of the rule that owns it
    matched: list[list[str]]  # per rule: every parameter it matches (owned or not)
    undecided: list[list[str]]  # per rule: parameters a module predicate could not decide
    owned_by: list[list[ParamInfo]]  # per rule: the parameters it owns

    @classmethod
    def match(cls, spec: Spec, params: list[ParamInfo], **extra):
        """Match ``params`` against ``spec``'s rules (``extra``: a subclass's own fields).

        Matching runs rule by rule over all tensors (:meth:`Matcher.select`), so its cost is one
        regex call per (rule, name), not a Python call per pair."""
        if any(p.role is None for p in params) and (spec.roles or any(r.match.role is not None for r in spec.rules)):
            ensure_roles(params, spec.roles)
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        owner_index: list[int | None] = [None] * len(trainable)
        matched: list[list[str]] = []
        undecided: list[list[str]] = []
        for i, rule in enumerate(spec.rules):
            if not trainable:  # the spec alone: nothing to match (and no pattern to compile)
                matched.append([])
                undecided.append([])
                continue
            hits, unknown = Matcher(rule.match).select(trainable)
            for j in hits:
                if owner_index[j] is None:
                    owner_index[j] = i
            matched.append([trainable[j].name for j in hits])
            undecided.append([trainable[j].name for j in unknown])
        owned_by: list[list[ParamInfo]] = [[] for _ in spec.rules]
        for p, owner_i in zip(trainable, owner_index):
            if owner_i is not None:
                owned_by[owner_i].append(p)
        owner = {p.name: owner_i for p, owner_i in zip(trainable, owner_index)}
        return cls(spec=spec, params=trainable, frozen=frozen, owner=owner, matched=matched, undecided=undecided,
                   owned_by=owned_by, **extra)

    def owned(self, i: int) -> list[ParamInfo]:
        return self.owned_by[i]


__all__ = ["Ownership"]
