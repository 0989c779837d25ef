"""Post-stage arithmetic that the step's tests leave free, pinned against float64 written here: the
column statistics of a view of two row blocks (each block its own matrix), and contra's power
normalization D/σ₁(D) on a direction of large entries, where only the normalized iterates keep the
sums of squares inside float32's range."""

from __future__ import annotations

import math

import pytest
import torch

from geomopt.compile.fragments import View
from geomopt.optim.units import stages
from geomopt.spec.updates import AxisNorm, SecondMoment


def _blocks64(u: torch.Tensor, sizes: list, fn) -> torch.Tensor:
    """``fn`` applied to each row block of each matrix of the stack on its own, concatenated."""
    return torch.stack([torch.cat([fn(b) for b in m.split(sizes, 0)], 0) for m in u])


@pytest.mark.parametrize("sizes", [[4, 2], [2, 2, 2]], ids=["two-blocks", "three-blocks"])
def test_the_column_statistics_of_a_view_are_each_blocks_own(sizes):
    """second_moment and axis_norm per column of a (6, 5) weight read as row blocks ``sizes``: each
    block's column mean of squares (sum, for axis_norm) over its own rows, against float64 per
    block; two blocks as well as three (a count that is neither one block nor the common three)."""
    view = View(batch=0, trailing="cols", blocks=tuple(sizes))
    gen = torch.Generator().manual_seed(0)
    rows = torch.logspace(-1, 1, 6, dtype=torch.float64)[:, None]
    u = torch.randn(2, 6, 5, generator=gen, dtype=torch.float64) * rows
    moment = SecondMoment(kind="second_moment", axis="column", beta2=0.5, eps=1e-3)
    got = stages.second_moment(u, moment, stages.Context(state={}, op_shape=(6, 5), view=view))
    want = _blocks64(u, sizes, lambda b: b / (torch.sqrt(0.5 * (b * b).mean(0, keepdim=True)) + 1e-3))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    norm = AxisNorm(kind="axis_norm", order=["column"], eps=1e-7)
    got = stages.axis_norm(u, norm, stages.Context(state={}, op_shape=(6, 5), view=view))
    want = _blocks64(u, sizes, lambda b: b / torch.sqrt((b * b).sum(0, keepdim=True) + 1e-7))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def _power64(d: torch.Tensor, steps: int) -> torch.Tensor:
    """D/σ̂₁ per matrix in float64: v₀ = 1/√n, w ← Dv/‖Dv‖, v ← Dᵀw/‖Dᵀw‖ ``steps`` times, σ̂₁ = ‖Dv‖."""
    out = []
    for m in d.double():
        v = torch.full((m.shape[1],), 1 / math.sqrt(m.shape[1]), dtype=torch.float64)
        for _ in range(steps):
            w = m @ v
            w = w / w.norm()
            v = m.T @ w
            v = v / v.norm()
        out.append(m / (m @ v).norm())
    return torch.stack(out)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 56, 2.0 ** -20], ids=["unit", "2^56", "2^-20"])
def test_contra_normalizes_a_direction_whatever_its_magnitude(scale):
    """contra's D/σ₁(D) (power iterations from the all-ones vector) on positive 8 × 64 directions
    scaled by powers of two from 2⁻²⁰ to 2⁵⁶ (entries up to 1.1e17: Σᵢ(Dv)ᵢ² about 2¹²¹, within
    float32's range only because each iterate is normalized before the next product): the float64
    iteration's result within float32 rounding, and the same bits as the unscaled direction's (a
    power of two scales every step exactly)."""
    gen = torch.Generator().manual_seed(1)
    d = 0.5 + torch.rand(2, 8, 64, generator=gen)
    u = torch.randn(2, 8, 64, generator=gen)
    cfg = {"coeff": 0.25, "power_steps": 3}

    def contra(direction):
        return stages.contra(u, cfg, stages.Context(state={}, op_shape=(8, 64), direction=direction))

    got = contra(d * scale)
    want = 1.25 * u.double() - 0.25 * _power64(d, 3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, contra(d))
