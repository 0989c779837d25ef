"""The finiteness test of every step (geomopt.optim.engine.nonfinite): the fast test (``sum_finite``) has
no false negatives (a NaN or ±∞ anywhere, in any tensor, is caught), the exact test (``finite``)
agrees entry for entry, neither writes to the gradients (bit for bit, NaN payloads included), and
the optimizer's elementwise path (the adam geometry, gradients as a list) skips a step with a
non-finite gradient leaving parameters, state and gradients exactly as they were, while a huge but
finite gradient whose sum overflows (the fast test's one false positive) still steps."""

from __future__ import annotations

import math

import pytest
import torch

import geomopt
from geomopt.optim.engine.nonfinite import finite, sum_finite
from optim_helpers import SPECS, loss_of, mlp_batch, same_snapshot, snapshot, tiny_mlp, train

ADAM = SPECS / "examples" / "adam-all.yaml"
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
BAD = [math.nan, math.inf, -math.inf]


def bits(ts: list) -> list:
    """Each tensor's bit pattern (an integer view: NaN payloads and -0.0 compare as bits)."""
    return [t.view(INT[t.dtype]).clone() for t in ts]


def same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def tensors(dtype, n: int, shape_2d: bool = False) -> list:
    """A gradient list as the flat path sees it: a 0-element tensor first (the list's device is read
    from its first tensor), small matrices, a transposed (non-contiguous) view, and one of n entries."""
    g = torch.Generator().manual_seed(n)
    big = torch.randn(n, generator=g).to(dtype)
    if shape_2d and n % 2 == 0:
        big = big.view(2, n // 2)
    return [torch.empty(0, dtype=dtype), torch.randn(5, 7, generator=g).to(dtype),
            torch.randn(7, 3, generator=g).to(dtype).t(), big, torch.randn(3, generator=g).to(dtype)]


def edge_values(dtype) -> torch.Tensor:
    """NaNs with payloads and both signs (quiet and signalling), -0.0, subnormals, ±∞, extremes."""
    if dtype == torch.float32:
        raw = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x00400000, -0x007FFFFF, 0x7FA5A5A5,
               -0x80000000, 0x00000001, -0x7F800001, 0x00400000, 0x7F800000, -0x00800000, 0x7F7FFFFF]
        return torch.tensor(raw, dtype=torch.int32).view(torch.float32)
    raw = [0x7FC0, 0x7F81, 0x7FFF, -0x0040, -0x007F, 0x7FA5, -0x8000, 0x0001, -0x7F81, 0x0040, 0x7F80, -0x0080, 0x7F7F]
    return torch.tensor(raw, dtype=torch.int16).view(torch.bfloat16)


# ---------------------------------------------------------------- the tests themselves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 3, 17, 1_000_003, 1 << 20])
@pytest.mark.parametrize("bad", BAD)
def test_no_false_negative_anywhere(dtype, n, bad):
    """A NaN or ±∞ at the first, a middle or the last entry of a tiny or big tensor is caught by
    the fast test (list and single tensor) and by the exact one, and the gradients keep every bit."""
    for where in sorted({0, n // 2, n - 1}):
        ts = tensors(dtype, n, shape_2d=True)
        big = ts[3].view(-1)
        big[where] = bad
        before = bits(ts)
        assert not bool(sum_finite(ts)), (where, ts[3].shape)
        assert not bool(sum_finite(ts[3]))
        assert not bool(finite(ts)) and not bool(finite(ts[3]))
        assert same_bits(before, bits(ts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot", [1, 2, 4])
def test_every_tensor_of_the_list_is_read(dtype, slot):
    """A NaN in a small tensor beside a big finite one (and in the transposed view) is caught."""
    ts = tensors(dtype, 1 << 16)
    ts[slot][(-1,) * ts[slot].dim()] = math.nan
    assert not bool(sum_finite(ts)) and not bool(finite(ts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_values_are_not_written(dtype):
    """NaN payloads (either sign), -0.0, subnormals and ±∞ come back bit for bit from both tests
    (a test that rewrote the gradients, e.g. g·1.0 through float in bfloat16, canonicalizes NaNs)."""
    edge = edge_values(dtype)
    for reps in (1, 64):  # the scalar tail and the vectorized body of a kernel
        ts = [torch.empty(0, dtype=dtype), edge.repeat(reps), torch.randn(4, 4).to(dtype)]
        before = bits(ts)
        assert not bool(sum_finite(ts)) and not bool(finite(ts))
        assert same_bits(before, bits(ts))
    finite_only = edge[torch.isfinite(edge)]
    ts = [finite_only.repeat(64)]
    assert bool(finite(ts))  # -0.0, subnormals and the largest finite value are finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_gradients_pass(dtype):
    ts = tensors(dtype, 1_000_003)
    assert bool(sum_finite(ts)) and bool(finite(ts))
    assert bool(sum_finite([torch.empty(0, dtype=dtype)])) and bool(finite([torch.empty(0, dtype=dtype)]))
    assert bool(sum_finite(torch.empty(0, dtype=dtype))) and bool(finite(torch.empty(0, dtype=dtype)))


def test_overflow_is_the_only_false_positive():
    """Huge finite entries may overflow the fast test (then the exact test decides): never the
    other way round."""
    ts = [torch.empty(0), torch.full((1000,), 3e38), torch.randn(10)]
    assert not bool(sum_finite(ts))
    assert bool(finite(ts))


# ---------------------------------------------------------------- the optimizer's step


def _model_and_opt(dtype):
    model = tiny_mlp(0, dtype=dtype)
    opt = geomopt.GeomOptimizer(model, ADAM)
    train(model, opt, 2, lambda k: mlp_batch(k, dtype=dtype))
    opt.zero_grad()
    loss_of(model, mlp_batch(5, dtype=dtype)).backward()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", BAD + ["nan-payload"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_adam_skips_a_nonfinite_step_bit_for_bit(dtype, bad, where):
    """The adam geometry (the elementwise path fused AdamW is compared with): a step with one bad
    entry is skipped and counted; parameters, optimizer state and every gradient keep every bit."""
    model, opt = _model_and_opt(dtype)
    g = model.layers[0].weight.grad
    i = 0 if where == "first" else g.numel() - 1
    if bad == "nan-payload":  # -NaN with a payload: any rewrite of the gradient would show
        g.view(-1).view(INT[dtype])[i] = -0x3FFFFF if dtype == torch.float32 else -0x3F
    else:
        g.view(-1)[i] = bad
    grads = [p.grad for p in model.parameters()]
    before, grad_bits = snapshot(opt), bits(grads)
    opt.step()
    assert same_snapshot(before, snapshot(opt))
    assert same_bits(grad_bits, bits(grads))
    assert opt.diagnostics()["all"]["skipped"] == 1
    train(model, opt, 1, lambda k: mlp_batch(k, dtype=dtype), start=6)  # and it goes on normally
    assert not same_snapshot(before, snapshot(opt))
    assert opt.diagnostics()["all"]["skipped"] == 1


def test_adam_steps_when_only_the_sum_overflows():
    """Huge finite gradients fail the fast test but pass the exact one: the step is taken."""
    model, opt = _model_and_opt(torch.float32)
    model.layers[0].weight.grad.fill_(3e38)
    before = snapshot(opt)
    opt.step()
    assert opt.diagnostics()["all"]["skipped"] == 0
    assert not same_snapshot(before, snapshot(opt))
