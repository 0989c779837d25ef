"""The float32 weights a step works on for compensated bfloat16 parameters (a rule's
``state: {compensation: …}``; the arithmetic: :mod:`geomopt.optim.units.compensation`).

Before the engine runs, each such parameter with a gradient holds its float32 weight (decoded from
the bf16 value and the state's error) and a float32 copy of its gradient, so every step program
runs exactly as on a float32 model (its programs are chosen for float32:
:func:`~geomopt.optim.units.compensation.step_dtype`). After
it, the weight is stored again as bf16 + error and the parameter gets its own gradient back. A
skipped step (a non-finite gradient) restores the bf16 tensors untouched and writes no state; a
step that raises stores what it wrote (the parameters it had not reached decode and encode to
their own bits)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from geomopt.optim.units.compensation import JOIN, KEY, LOW, SPLIT, compensated

#: parameter dtypes a compensated rule may also hold: they keep their value exactly
EXACT = (torch.float32, torch.float64)


class Masters:
    """The optimizer's compensated parameters: ``(parameter, compensation)`` pairs, in order."""

    def __init__(self, param_groups: list, plans: list):
        for g, pps in zip(param_groups, plans):
            kind = pps[0].compensation
            if kind == "none":
                continue
            other = [(pp.name, p.dtype) for p, pp in zip(g["params"], pps) if p.dtype not in (*LOW, *EXACT)]
            if other:
                name, dtype = other[0]
                raise ValueError(f"rule '{g['rule']}' has compensation {kind}, which keeps the rounding error of "
                                 f"bfloat16 weights, but '{name}' is {dtype}: cast it to bfloat16 or move it to a "
                                 f"rule without compensation")
            if not any(p.dtype in LOW for p in g["params"]):
                raise ValueError(f"rule '{g['rule']}' has compensation {kind}, but its tensors ('{pps[0].name}', …) "
                                 f"are all float32, which lose nothing: cast the model to bfloat16 "
                                 f"(model.to(torch.bfloat16)) or remove compensation from the rule")
        self.entries = [(p, pp.compensation) for g, pps in zip(param_groups, plans)
                        for p, pp in zip(g["params"], pps) if compensated(pp, p.dtype)]

    @contextlib.contextmanager
    def around(self, state, every: bool = False) -> Iterator[list]:
        """Float32 weights and gradients in the parameters with a gradient (``every``: in all of
        them, gradients untouched: the projection at construction) while the block runs; the block
        sets ``flag[0] = False`` when the step was skipped (nothing written: nothing is stored). An
        error of 0 where none was kept stays unkept (a weight the block did not move)."""
        swapped = []
        flag = [True]
        try:
            for p, kind in self.entries:
                g = p.grad
                if g is None and not every:
                    continue
                err = state[p].get(KEY) if p in state else None
                x = p.detach().float() if err is None else JOIN[kind](p.detach(), err)
                w = p.data
                p.grad = None  # a gradient must match its tensor's dtype: swapped after the data
                p.data = x
                p.grad = None if g is None else g.float()
                swapped.append((p, kind, w, g, err is not None))
            yield flag
        finally:
            for p, kind, w, g, kept in swapped:
                if flag[0]:
                    new, err = SPLIT[kind](p.detach())
                    w.copy_(new)  # into the parameter's own storage (views of it, a wrapper's, stay bound)
                    if kept or bool(err.any()):
                        state[p][KEY] = err
                p.grad = None
                p.data = w
                p.grad = g
