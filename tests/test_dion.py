"""The ``dion`` direction (Ahn et al. 2025, arXiv:2504.05295; microsoft/dion): its rank read as
a number or a fraction, the rank refused where the matrix is smaller (naming the tensor and its
shape), the state it keeps (surviving state_dict and a skipped non-finite step), its batched
buckets against a float64 transcription, and full-rank Dion with μ = 0 converging to the exact
orthonormal (polar) factor on a constant gradient, checked by an SVD."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import geomopt
from geomopt.optim.units.directions import dion_rank
from geomopt.spec.diagnostics import SpecError
from optim_helpers import same_snapshot, snapshot


def dion_spec(rank=0.5, mu=0.95, lr=0.01, wd=0.1, eps=1e-8) -> dict:
    return {"geomopt": 1, "name": "dion-test", "defaults": {"lr": lr, "weight_decay": wd},
            "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                       "direction": {"kind": "dion", "rank": rank, "mu": mu, "eps": eps}}]}


class Matrices(nn.Module):
    """Two 6×6 matrices (one bucket), a 6×8 one and a conv kernel (4, 2, 3, 3): a 4×18 matrix."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(6, 6))
        self.b = nn.Parameter(torch.randn(6, 6))
        self.c = nn.Parameter(torch.randn(6, 8))
        self.k = nn.Parameter(torch.randn(4, 2, 3, 3))


def transcription(x: torch.Tensor, g: torch.Tensor, st: dict, *, rank, mu, lr, wd, eps=1e-8) -> torch.Tensor:
    """One step of Algorithm 1 (arXiv:2504.05295; microsoft/dion's dion_simple.py) in float64 on the
    (shape[0], rest) matrix of ``x``: B = M + G, P = QR(BQ), R = BᵀP, M ← B − (1 − μ)PRᵀ,
    Q ← R/(‖R_j‖ + ε), X ← X(1 − ηλ) − η√(m/n)PQᵀ; Q⁰ Gaussian from a CPU generator seeded 0."""
    shape = x.shape
    x, g = x.reshape(shape[0], -1), g.reshape(shape[0], -1)
    m, n = x.shape
    if not st:
        r = rank if isinstance(rank, int) else math.ceil(rank * min(m, n))
        st["M"] = torch.zeros_like(x)
        st["Q"] = torch.randn(n, r, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    b = st["M"] + g
    p, _ = torch.linalg.qr(b @ st["Q"])
    r_ = b.T @ p
    st["M"] = b - (1 - mu) * p @ r_.T
    st["Q"] = r_ / (r_.norm(dim=0, keepdim=True) + eps)
    return (x * (1 - lr * wd) - lr * math.sqrt(m / n) * p @ st["Q"].T).reshape(shape)


def grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


def run_steps(model, opt, steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        for p, g in zip(model.parameters(), grads(model, k)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("rank, shape, expected", [(3, (6, 8), 3), (0.5, (6, 8), 3), (0.25, (6, 8), 2),
                                                    (1.0, (6, 8), 6), (0.01, (6, 8), 1), (4, (4, 2, 3, 3), 4),
                                                    (0.5, (4, 2, 3, 3), 2), (0.5, (8, 2), 1)])
def test_rank_is_a_number_or_a_fraction_of_the_smaller_side(rank, shape, expected):
    assert dion_rank(rank, shape) == expected
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(shape))
    opt = geomopt.GeomOptimizer(model, dion_spec(rank=rank))
    model.w.grad = torch.randn(shape)
    opt.step()
    n = math.prod(shape[1:])
    assert opt.state[model.w]["dion_q"].shape == (n, expected)
    assert opt.state[model.w]["d"].shape == shape


def test_int_and_fraction_give_the_same_step():
    """rank 3 and rank 0.5 on 6×8 matrices are the same rank: the same bits."""
    out = []
    for rank in (3, 0.5):
        model = Matrices()
        del model.k
        run_steps(model, geomopt.GeomOptimizer(model, dion_spec(rank=rank)), 3)
        out.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_rank_larger_than_the_matrix_is_refused_naming_tensor_and_shape():
    model = Matrices()
    with pytest.raises(SpecError) as exc:
        geomopt.GeomOptimizer(model, dion_spec(rank=5))
    messages = [d.message for d in exc.value.diagnostics]
    assert [d.code for d in exc.value.diagnostics] == ["GO104"]
    # the 4×18 conv matrix is the only one with min(m, n) < 5
    assert len(messages) == 1 and "'k'" in messages[0] and "4×2×3×3" in messages[0]
    assert "dion rank 5" in messages[0] and "4×18" in messages[0]


def test_a_vector_is_refused():
    model = nn.Linear(4, 3)
    with pytest.raises(SpecError) as exc:
        geomopt.GeomOptimizer(model, dion_spec())
    assert any("'bias'" in d.message and "needs a matrix" in d.message for d in exc.value.diagnostics)


@pytest.mark.parametrize("rank", [0.5, 1])
def test_matches_the_float64_transcription_batched_and_alone(rank):
    """Two same-shape matrices stacked in one bucket, a lone one and a conv kernel, against
    Algorithm 1 in float64, for 5 steps."""
    model = Matrices()
    opt = geomopt.GeomOptimizer(model, dion_spec(rank=rank))
    xs = [p.detach().double().clone() for p in model.parameters()]
    states: list = [{} for _ in xs]
    for k in range(5):
        gs = grads(model, k)
        for p, g in zip(model.parameters(), gs):
            p.grad = g
        opt.step()
        xs = [transcription(x, g.double(), st, rank=rank, mu=0.95, lr=0.01, wd=0.1) for x, g, st in zip(xs, gs, states)]
    for p, x, st in zip(model.parameters(), xs, states):
        assert float((p.detach().double() - x).norm() / x.norm()) < 1e-6
        assert float((opt.state[p]["d"].double().reshape(st["M"].shape) - st["M"]).norm() / st["M"].norm()) < 1e-5


def test_state_survives_state_dict():
    """3 steps, save, load into a fresh optimizer on a copy of the model: the next 3 steps are the
    same bits as the uninterrupted run's."""
    model = Matrices()
    opt = geomopt.GeomOptimizer(model, dion_spec())
    run_steps(model, opt, 3)
    saved = opt.state_dict()
    clone = Matrices()
    clone.load_state_dict(model.state_dict())
    opt2 = geomopt.GeomOptimizer(clone, dion_spec())
    opt2.load_state_dict(saved)
    run_steps(model, opt, 3, start=3)
    run_steps(clone, opt2, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(opt.state[a]["dion_q"], opt2.state[b]["dion_q"])
        assert torch.equal(opt.state[a]["d"], opt2.state[b]["d"])


@pytest.mark.parametrize("first", [True, False])
def test_nonfinite_gradient_leaves_params_and_state(first):
    model = Matrices()
    opt = geomopt.GeomOptimizer(model, dion_spec())
    if not first:
        run_steps(model, opt, 2)
    before = snapshot(opt)
    for p, g in zip(model.parameters(), grads(model, 7)):
        p.grad = g
    model.c.grad[1, 2] = float("nan")
    opt.step()
    assert same_snapshot(before, snapshot(opt))


def test_full_rank_with_no_momentum_converges_to_the_polar_factor():
    """Full rank, μ = 0: M ← B − PPᵀB = 0, so each step is one step of subspace iteration on GGᵀ
    for a constant G, P → U and PQᵀ = PD⁻¹PᵀG → UVᵀ, the exact orthonormal factor (Muon's with an
    SVD). Checked on the step X⁺ − X = −η√(m/n)·PQᵀ (no decay) against torch.linalg.svd."""
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(7, 5, dtype=torch.float64))
    g = u @ torch.diag(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64)) @ v.T
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(5, 7, dtype=torch.float64))
    lr = 1e-3
    opt = geomopt.GeomOptimizer(model, dion_spec(rank=1.0, mu=0.0, lr=lr, wd=0.0, eps=1e-30))
    for _ in range(60):
        before = model.w.detach().clone()
        model.w.grad = g.clone()
        opt.step()
    step = (before - model.w.detach()) / (lr * math.sqrt(5 / 7))
    uu, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert float(opt.state[model.w]["d"].abs().max()) < 1e-12  # μ = 0, full rank: nothing left over
    assert float((step - uu @ vh).norm()) < 1e-8
