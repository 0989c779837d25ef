"""``state: int8-ec``: int8 codes plus a 4-bit correction per entry, its position within its code's
bin, stochastically rounded and added back at each decode (geomopt.optim.persist.state_codec). The
codec's arithmetic against float64 references (the correction is what int8 dropped, to a 15th of
the bin; it is unbiased), a slowly varying moment kept through many encode/decode cycles (its
error stays under a bound that does not grow with the cycles, while int8's grows past it), the
sharded codec (each shard encodes what one process does) and a skipped step (the load checks:
tests/test_load_validation.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import gpt_batch, loss_of, tiny_gpt

import geomopt
from geomopt.optim.persist.codes import (BLOCK, STEPS, bin_edges, block_scaled, decode_int8, decode_int8_ec,
                                         dynamic_map, encode_correction, encode_int8, noise, pack4, seed_of, unpack4)
from geomopt.optim.persist.state_codec import Codec
from geomopt.optim.units.state_keys import CORRECTION, SCALE

pytestmark = pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")


def _block(seed: int, signed: bool, rows: int = 2, spread: float = 3.0) -> torch.Tensor:
    """``rows`` blocks of values over several decades (log-uniform magnitudes), signed or not."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.rand(rows, BLOCK, generator=g, dtype=torch.float64) * -spread * math.log(10))
    sign = torch.where(torch.rand(rows, BLOCK, generator=g) < 0.5, -1.0, 1.0).double() if signed else 1.0
    return (mag * sign).float()


def _reference(x: torch.Tensor, signed: bool):
    """float64: each entry's code c (int8's), block scale a, bin [E_c, E_{c+1}) and position
    15·(x/a − E_c)/(E_{c+1} − E_c) in it, from the map's values (the bins' edges are the midpoints
    between neighbouring codes; the ends −1 or 0, and 1)."""
    codes, absmax = encode_int8(x, signed)
    qmap = dynamic_map(signed).double()
    edges = torch.cat([torch.tensor([-1.0 if signed else 0.0], dtype=torch.float64), (qmap[1:] + qmap[:-1]) / 2,
                       torch.tensor([1.0], dtype=torch.float64)])
    c = codes.reshape(-1).long()
    a = absmax.double().repeat_interleave(BLOCK, -1).reshape(-1)
    lo, hi = edges[c], edges[c + 1]
    pos = (x.double().reshape(-1) / a - lo) / (hi - lo) * STEPS
    return codes, absmax, a, lo, hi, pos


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), signed=st.booleans(), spread=st.floats(0.5, 7.0))
def test_the_correction_is_what_int8_dropped_to_a_15th_of_the_bin(seed, signed, spread):
    """The codes are int8's; each correction t is one of the two integers around 15× the value's
    position in its bin (the nearest one without random bits), so the decoded residual
    a·(E_c + t/15·w) − a·map_c is x − a·map_c (what int8 drops) within a·w/15 (a·w/30 rounded to the
    nearest), in float64."""
    x = _block(seed, signed, spread=spread)
    codes, absmax, a, lo, hi, pos = _reference(x, signed)
    scaled, m = block_scaled(x)
    assert torch.equal(m, absmax)
    bits = noise([seed_of("w", seed, "d")] * x.shape[0], tuple(x.shape))
    for b in (bits.reshape(-1), None):
        t = encode_correction(scaled, codes.reshape(-1), signed, b).long()
        assert int(t.min()) >= 0 and int(t.max()) <= STEPS
        slack = 1e-4  # float32's scaled value against float64's
        if b is None:
            assert bool(((t - pos).abs() <= 0.5 + slack).all())
        else:
            assert bool(((t >= torch.floor(pos - slack)) & (t <= torch.ceil(pos + slack))).all())
        back = decode_int8_ec(codes, t.to(torch.uint8).reshape(x.shape), absmax, signed).double().reshape(-1)
        plain = decode_int8(codes, absmax, signed).double().reshape(-1)
        lost, kept = x.double().reshape(-1) - plain, back - plain
        width = a * (hi - lo)
        bound = width / STEPS / (2 if b is None else 1)
        assert bool(((kept - lost).abs() <= bound * (1 + 1e-3) + 1e-6 * a).all())
        if not signed:
            assert bool((back >= 0).all())  # a second moment decodes non-negative


def test_the_corrections_pack_two_to_a_byte_and_the_block_extremes_are_exact():
    t = torch.randint(0, 16, (4 * BLOCK,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack4(t)
    assert packed.dtype == torch.uint8 and packed.numel() == t.numel() // 2
    assert torch.equal(packed, t[0::2] + 16 * t[1::2]) and torch.equal(unpack4(packed), t)
    for signed in (True, False):
        edges = bin_edges(signed)
        assert edges.numel() == 257 and bool((edges[1:] > edges[:-1]).all())
        x = _block(1, signed)
        x[0, 7], x[1, 9] = 2.5, (-3.0 if signed else 3.0)  # each block's largest magnitude
        scaled, m = block_scaled(x)
        codes, _ = encode_int8(x, signed)
        t = encode_correction(scaled, codes.reshape(-1), signed, noise([1, 2], tuple(x.shape)).reshape(-1))
        back = decode_int8_ec(codes, t.reshape(x.shape), m, signed)
        assert float(back[0, 7]) == 2.5 and float(back[1, 9]) == float(x[1, 9])


def test_the_correction_is_unbiased():
    """Over 4000 seeds' random bits, each value's mean decode is the value (within 4.5 standard
    errors of a draw between two neighbours a·w/15 apart): kept on average, as bf16's rounding."""
    x = _block(3, True, rows=1)
    codes, absmax, a, lo, hi, pos = _reference(x, True)
    scaled, _ = block_scaled(x)
    n = 4000
    total = torch.zeros(BLOCK, dtype=torch.float64)
    for s in range(n):
        t = encode_correction(scaled, codes.reshape(-1), True, noise([s], tuple(x.shape)).reshape(-1))
        total += decode_int8_ec(codes, t.reshape(x.shape), absmax, True).double().reshape(-1)
    step = a * (hi - lo) / STEPS
    assert bool(((total / n - x.double().reshape(-1)).abs() <= 4.5 * step * 0.5 / n ** 0.5 + 1e-7 * a).all())


def _cycles(dtype: str, g: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An EMA m ← β·m + (1 − β)·g_k of the rows g_k, kept in ``dtype`` between steps as a bucket
    keeps it (decode, update in float32, encode with the step count): per cycle, the largest
    |stored − m| of float64's m over the largest |m|, and the largest rounding of one encode."""
    codec_m, err, rounding = torch.zeros(g.shape[1:], dtype=torch.float64), [], []
    state = {"d": g[0].float().clone()}
    codec_m.copy_(g[0].double())
    for k in range(1, g.shape[0]):
        y = Codec.decode(state)["d"] * beta + (1 - beta) * g[k].float()
        state = Codec(dtype, ("w0", "w1"), k).encode({"d": y})
        back = Codec.decode(state)["d"]
        codec_m = beta * codec_m + (1 - beta) * g[k].double()
        scale = codec_m.abs().max()
        err.append(float((back.double() - codec_m).abs().max() / scale))
        rounding.append(float((back.double() - y.double()).abs().max() / scale))
    return torch.tensor(err), torch.tensor(rounding)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.8, 0.95), drift=st.floats(0.3, 1.0))
def test_a_slowly_varying_moment_keeps_a_bounded_error_where_int8s_grows(seed, beta, drift):
    """A moment tracking a slowly drifting signal (each entry moves by ``drift``·its start over 200
    cycles): int8's nearest code holds while the change per cycle is below half a bin, so its
    error grows with the cycles; int8-ec's corrections carry what each encode rounds, and its
    error at every cycle stays within the sum of the roundings geometrically forgotten,
    max rounding / (1 − β) (float32's update adds ~1e-7 a cycle), a bound the cycles do not raise,
    which int8's error passes."""
    g0 = _block(seed, True, spread=1.5).double()
    direction = torch.where(torch.rand(g0.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.5, -1.0, 1.0)
    k = torch.arange(201, dtype=torch.float64).reshape(-1, 1, 1) / 200
    g = g0 * (1 + drift * k * direction.double())
    ec, rounding = _cycles("int8-ec", g, beta)
    plain, _ = _cycles("int8", g, beta)
    bound = float(rounding.max()) / (1 - beta) + 1e-5
    assert float(ec.max()) <= bound
    assert float(plain[-50:].max()) > 2 * bound  # int8's stalled codes drift past it
    assert float(plain[-50:].max()) > 3 * float(plain[0])  # its error grew with the cycles
    assert float(ec[-50:].max()) <= 2 * float(ec[:50].max())  # int8-ec's did not


def test_each_shard_encodes_what_one_process_does():
    """A (4, 512) tensor cut at a multiple of 256 along its last dim, or by rows: each shard's codes,
    scales and corrections (its random bits drawn by the entries' indices in the whole) are the
    slices of one process's."""
    x = _block(5, True, rows=8).reshape(1, 4, 512)
    whole = Codec("int8-ec", ("w",), 3).encode({"d": x})
    assert whole["d" + CORRECTION].shape == (1, 4, 256) and whole["d" + SCALE].shape == (1, 4, 2)
    for start, block in (((0, 256), (slice(None), slice(256, 512))), ((2, 0), (slice(2, 4), slice(None)))):
        part = x[(slice(None), *block)].contiguous()
        shard = Codec("int8-ec", ("w",), 3, start=start, full=(4, 512), aligned=True).encode({"d": part})
        half = (block[0], slice(block[1].start // 2, block[1].stop // 2) if block[1].start else block[1])
        scales = (block[0], slice(block[1].start // BLOCK, block[1].stop // BLOCK) if block[1].start else block[1])
        assert torch.equal(shard["d"][0], whole["d"][0][block])
        assert torch.equal(shard["d" + SCALE][0], whole["d" + SCALE][0][scales])
        assert torch.equal(shard["d" + CORRECTION][0], whole["d" + CORRECTION][0][half])
    unaligned = Codec("int8-ec", ("w",), 3, start=(0, 128), full=(4, 512), aligned=False).encode({"d": x[..., :256]})
    assert unaligned["d"].dtype == torch.float32 and "d" + CORRECTION not in unaligned


SPEC = {"geomopt": 1, "name": "ec", "rules": [
    {"name": "hidden", "match": {"role": "hidden"}, "state": "int8-ec", "direction": {"kind": "polyak", "alpha": 0.1},
     "geometry": {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}},
    {"name": "rest", "match": "**", "geometry": {"kind": "adam"}, "state": "int8-ec"}]}


def _stepped(steps: int = 2):
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, SPEC)
    for k in range(steps):
        for p in model.parameters():
            p.grad = None
        loss_of(model, gpt_batch(k)).backward()
        opt.step()
    return model, opt


def test_a_nonfinite_gradient_leaves_codes_scales_and_corrections_untouched():
    model, opt = _stepped()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss_of(model, gpt_batch(5)).backward()
    next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
    opt.step()
    after = opt.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for i, st_ in before["state"].items():
        for key, v in st_.items():
            w = after["state"][i][key]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), key
    assert any(CORRECTION in key for st_ in before["state"].values() for key in st_)
