"""The post-stages' statistics forms (stages.row_factor: a chain of second_moment by rows and
rms_match as one factor per row from the rows' sums of squares) against NorMuon's post-stages
written here in float64, entry by entry, and against the eager stages: every target of the norm
match, with and without bias correction, the state updated in place or fresh, a step count as a
number or as a tensor, a matrix and a conv kernel's (out, in, k) stack, in both orders."""

from __future__ import annotations

import math

import pytest
import torch

from geomopt.optim.units import stages
from geomopt.spec.updates import RmsMatch, SecondMoment


def _moment64(u: torch.Tensor, v: torch.Tensor | None, beta2: float, eps: float, step: int,
              bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's second moment by rows in float64 (u: (B, m, ...)): v ← β₂v + (1−β₂)·mean_j U²_ij
    over each row's n entries, U ← U/(√(v/c) + ε), c = 1 − β₂ᵗ with bias correction else 1."""
    rows = u.reshape(u.shape[0], u.shape[1], -1)
    m2 = (rows * rows).sum(-1) / rows.shape[-1]
    v = (1 - beta2) * m2 if v is None else beta2 * v + (1 - beta2) * m2
    c = 1 - beta2 ** step if bias else 1.0
    denom = torch.sqrt(v / c) + eps
    return (rows / denom[..., None]).reshape(u.shape), v


def _target64(target, u_in: torch.Tensor, op_shape: tuple) -> torch.Tensor:
    """T per tensor (B,): ‖U‖_F as the geometry gave it (``input``), 1 (``unit``), √min(m, n) of the
    (out, rest) matrix (``polar``), or t·√(entries) for a number t."""
    b = u_in.shape[0]
    if target == "input":
        return u_in.reshape(b, -1).norm(dim=1)
    if target == "unit":
        return torch.ones(b, dtype=torch.float64)
    m, n = op_shape[0], math.prod(op_shape[1:])
    if target == "polar":
        return torch.full((b,), math.sqrt(min(m, n)), dtype=torch.float64)
    return torch.full((b,), target * math.sqrt(m * n), dtype=torch.float64)


def _rms64(u: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """U·T/(‖U‖_F + ε) per tensor."""
    norm = u.reshape(u.shape[0], -1).norm(dim=1)
    return u * (target / (norm + eps)).reshape(-1, *[1] * (u.ndim - 1))


def _reference(us: list, chain: list, op_shape: tuple, eps_rms: float) -> list:
    """The chain applied entry by entry in float64 to each step's update: (result, v) per step."""
    v, out = None, []
    for k, u in enumerate(us, start=1):
        u_in, x = u, u
        for kind, cfg in chain:
            if kind == "moment":
                x, v = _moment64(x, v, step=k, **cfg)
            else:
                x = _rms64(x, _target64(cfg, u_in, op_shape), eps_rms)
        out.append((x, v))
    return out


def _updates(op_shape: tuple, steps: int, seed: int) -> list:
    """``steps`` stacks of two tensors whose rows span three decades, the second 10× the first."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-2, 1, op_shape[0], dtype=torch.float64).reshape(1, -1, *[1] * (len(op_shape) - 1))
    size = torch.tensor([1.0, 10.0], dtype=torch.float64).reshape(2, *[1] * len(op_shape))
    return [torch.randn(2, *op_shape, generator=gen, dtype=torch.float64) * rows * size for _ in range(steps)]


def _post(chain: list, eps_rms: float) -> list:
    return [SecondMoment(kind="second_moment", axis="row", **cfg) if kind == "moment"
            else RmsMatch(kind="rms_match", target=cfg, eps=eps_rms) for kind, cfg in chain]


TARGETS = ["input", "unit", "polar", 0.2]


@pytest.mark.parametrize("op_shape", [(12, 7), (6, 3, 2)], ids=["matrix", "conv"])
@pytest.mark.parametrize("bias", [False, True], ids=["normuon", "bias-corrected"])
@pytest.mark.parametrize("target", TARGETS, ids=str)
@pytest.mark.parametrize("fresh", [False, True], ids=["in-place", "fresh"])
def test_the_row_factor_is_normuon_written_entry_by_entry(op_shape, bias, target, fresh):
    """Three steps of [second_moment by rows, rms_match]: F⊙U and the state post_v within float64
    rounding of the reference (ε large enough, 1e-3 and 1e-2, that a sign or a misplaced ε shows),
    the same as the eager stages' result; ss·f² carried to the norm match (its ‖·‖_F is of the
    moment's output)."""
    moment = {"beta2": 0.9, "eps": 1e-3, "bias": bias}
    chain = [("moment", moment), ("rms", target)]
    post = [SecondMoment(kind="second_moment", axis="row", beta2=0.9, eps=1e-3, bias_correction=bias),
            RmsMatch(kind="rms_match", target=target, eps=1e-2)]
    us = _updates(op_shape, 3, seed=0)
    refs = _reference(us, chain, op_shape, eps_rms=1e-2)
    dims = tuple(range(2, len(op_shape) + 1))
    rows_state: dict = {}
    eager_state: dict = {}
    for k, (u, (want, v)) in enumerate(zip(us, refs), start=1):
        ctx = stages.Context(state=rows_state, op_shape=op_shape, step=k, fresh=fresh)
        assert stages.row_dims(post, ctx) == dims
        ss = (u * u).sum(dim=dims, keepdim=True)
        factor = stages.row_factor(ss, post, ctx)
        assert factor.shape == ss.shape
        torch.testing.assert_close(factor * u, want, rtol=1e-12, atol=0)
        assert ctx.reduced["post_v"] == dims
        torch.testing.assert_close(rows_state["post_v"].reshape(v.shape), v, rtol=1e-12, atol=0)
        eager = stages.run(u, post, stages.Context(state=eager_state, op_shape=op_shape, step=k, fresh=fresh))
        torch.testing.assert_close(eager, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_a_norm_match_before_the_moment_feeds_it_the_matched_rows(target):
    """[rms_match, second_moment]: the moment's mean of squares is of the matched update (the
    input's ss times f²), whose own ‖·‖ the reference reads; and a step count given as a device
    tensor (a capturable step's) is the number's bias correction."""
    op_shape = (12, 7)
    moment = {"beta2": 0.8, "eps": 1e-3, "bias": True}
    chain = [("rms", target), ("moment", moment)]
    post = [RmsMatch(kind="rms_match", target=target, eps=1e-2),
            SecondMoment(kind="second_moment", axis="row", beta2=0.8, eps=1e-3, bias_correction=True)]
    us = _updates(op_shape, 3, seed=1)
    state: dict = {}
    for k, (u, (want, v)) in enumerate(zip(us, _reference(us, chain, op_shape, eps_rms=1e-2)), start=1):
        ctx = stages.Context(state=state, op_shape=op_shape, step=torch.tensor(float(k)), fresh=True)
        ss = (u * u).sum(dim=2, keepdim=True)
        torch.testing.assert_close(stages.row_factor(ss, post, ctx) * u, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(state["post_v"].reshape(v.shape), v, rtol=1e-12, atol=0)


def test_the_moment_alone_and_an_exact_first_step():
    """second_moment by rows alone, β₂ = 0.5: at step 1 with bias correction v/c is the row's mean
    square itself, so F = 1/(rms_i + ε) exactly as computed here; the in-place state is the same
    tensor after each step, and its values follow the lerp."""
    op_shape = (5, 4)
    post = [SecondMoment(kind="second_moment", axis="row", beta2=0.5, eps=0.25, bias_correction=True)]
    u = _updates(op_shape, 1, seed=2)[0]
    state: dict = {}
    ctx = stages.Context(state=state, op_shape=op_shape, step=1)
    ss = (u * u).sum(dim=2, keepdim=True)
    factor = stages.row_factor(ss, post, ctx)
    rms = (ss / 4).sqrt()
    torch.testing.assert_close(factor, 1 / (rms + 0.25), rtol=1e-14, atol=0)
    torch.testing.assert_close(state["post_v"], 0.5 * ss / 4, rtol=1e-14, atol=0)
    v = state["post_v"]
    u2 = 2 * u
    stages.row_factor((u2 * u2).sum(dim=2, keepdim=True), post, stages.Context(state=state, op_shape=op_shape, step=2))
    assert state["post_v"] is v
    torch.testing.assert_close(v, 0.5 * (0.5 * ss / 4) + 0.5 * 4 * ss / 4, rtol=1e-14, atol=0)
