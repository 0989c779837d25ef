"""Step-size schedules of the paper's theorems, as multipliers of the group's ``lr``.

``fn(group, k) -> (gamma, alpha)`` for step k = 0, 1, …; ``alpha`` None keeps the direction's own.
The group's ``lr`` stays the scheduler-visible base, so any torch LR scheduler composes on top
(outside the theorems: say so when you report results).
"""

from __future__ import annotations

from geomopt.registry import Registry

SCHEDULES = Registry("schedule")
schedule = SCHEDULES.register


@schedule("constant")
def constant(group, k):
    """γ_k = lr."""
    return group["lr"], None


@schedule("theory")
def theory(group, k):
    """Theorem 4.3 (Polyak momentum, horizon K): γ = γ̄(K+1)^(−3/4), α = (K+1)^(−1/2), constant
    over the run; ``lr`` multiplies γ (lr = 1 is the theorem)."""
    s = group["schedule"]
    horizon = s["horizon"] + 1
    return group["lr"] * s["gamma_bar"] * horizon ** -0.75, horizon ** -0.5


@schedule("storm")
def storm(group, k):
    """Theorem 4.5 (STORM): α_k = γ_k = (k+1)^(−2/3); no free scale (put scale in the radius ρ);
    ``lr`` multiplies γ_k (lr = 1 is the theorem)."""
    a = (k + 1) ** (-2.0 / 3.0)
    return group["lr"] * a, a


def step_size(group: dict) -> tuple:
    """(γ, α) of the group's coming step: its schedule at its step count, the warmup applied to α.
    The schedule is read off the group (a torch param group: a plain dict, saved in the state
    dict), so what a user or a load puts there is what the step runs."""
    gamma, alpha = SCHEDULES[group["schedule"]["kind"]](group, group["step"])
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
