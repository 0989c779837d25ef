"""Step-size schedules of the paper's theorems, as multipliers of the group's ``lr``.

``fn(group, schedule, k) -> (gamma, alpha)`` for step k = 0, 1, …, ``schedule`` the group's
schedule as its typed spec model; ``alpha`` None keeps the direction's own. The group's ``lr``
stays the scheduler-visible base, so any torch LR scheduler composes on top (outside the
theorems: say so when you report results).

A torch param group holds its ``schedule`` as plain data (it is saved in the state dict, and a
user may edit it): :func:`typed_schedules` validates it through the spec's model when it
changes, so a step reads the model's attributes, never the group's dict by key.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from geomopt.registry import Registry
from geomopt.spec.updates import Schedule, StormSchedule, TheorySchedule

SCHEDULES = Registry("schedule")
schedule = SCHEDULES.register

_SCHEDULE: TypeAdapter[Schedule] = TypeAdapter(Schedule)


@schedule("constant")
def constant(group, s, k):
    """γ_k = lr."""
    return group["lr"], None


@schedule("theory")
def theory(group, s: TheorySchedule, k):
    """Theorem 4.3 (Polyak momentum, horizon K): γ = γ̄(K+1)^(−3/4), α = (K+1)^(−1/2), constant
    over the run; ``lr`` multiplies γ (lr = 1 is the theorem)."""
    horizon = s.horizon + 1
    return group["lr"] * s.gamma_bar * horizon ** -0.75, horizon ** -0.5


@schedule("storm")
def storm(group, s: StormSchedule, k):
    """Theorem 4.5 (STORM): α_k = γ_k = (k+1)^(−2/3); no free scale (put scale in the radius ρ);
    ``lr`` multiplies γ_k (lr = 1 is the theorem)."""
    a = (k + 1) ** (-2.0 / 3.0)
    return group["lr"] * a, a


def typed_schedule(group: dict) -> Schedule:
    """A param group's ``schedule`` (plain data, as saved in the state dict) as the spec's typed
    model; a value the spec would refuse is refused here with the spec's message."""
    try:
        return _SCHEDULE.validate_python(group["schedule"])
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in ("schedule", *first["loc"]))
        raise ValueError(f"param group of rule {group.get('rule')!r}: {where}: {first['msg']} "
                         f"(got {group['schedule']!r}); set it as a spec's schedule is written, "
                         f"e.g. {{'kind': 'constant'}}") from None


def step_size(group: dict, s: Schedule) -> tuple:
    """(γ, α) of the group's coming step: its schedule ``s`` (:func:`typed_schedule` of the
    group's value) at its step count, the warmup applied to α."""
    gamma, alpha = SCHEDULES[s.kind](group, s, group["step"])
    return gamma, warmup_alpha(alpha, group)


def warmup_alpha(alpha, group: dict):
    """α of this step under a Polyak momentum warmup: from the group's ``warmup_alpha`` at step 0
    linearly to its ``alpha`` at ``warmup_steps``, then its α (a schedule's own α wins)."""
    steps = group.get("warmup_steps", 0)
    if alpha is not None or not steps:
        return alpha
    frac = min(group["step"] / steps, 1.0)
    start = group["warmup_alpha"]
    return start + (group["alpha"] - start) * frac
