"""State precision per rule (``state: float32 | bfloat16 | int8 | int8-ec``): the int8 codec against torchao's
8-bit optimizer state (its published map and quantizer, and its AdamW8bit on the same tensors),
bf16 stochastic rounding against its definition (unbiased, one of the two neighbours, seeded),
each precision tracking float32 iterates over 200 steps, the bytes held, checkpoints and
migration between precisions, and the refusals."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from optim_helpers import gpt_batch, loss_of, tiny_gpt

import geomopt
from geomopt.optim.persist.codes import (decode_int8, decode_int8_ec, dynamic_map, encode_bf16, encode_int8,
                                         nearest_codes, noise, unpack4)
from geomopt.optim.units.state_keys import CORRECTION, SCALE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.optim import AdamW8bit
    from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap, scale_tensor

pytestmark = pytest.mark.filterwarnings("ignore::geomopt.UnusedRuleWarning")

SPECTRAL = {"kind": "spectral", "reference": {"kind": "indicator"}, "approx": {"kind": "newton_schulz"}}


def _spec(dtype: str, geometry: dict, direction: dict | None = None) -> dict:
    rule = {"name": "all", "match": "**", "geometry": geometry, "lr": 1e-3, "state": dtype}
    rules = [dict(rule, direction=direction)] if direction else [rule]
    if geometry["kind"] == "spectral":  # matrices only; the rest Adam in the same precision
        rules = [dict(rules[0], match={"role": "hidden"}), dict(rule, name="rest", geometry={"kind": "adam"})]
    return {"geomopt": 1, "name": "s", "rules": rules}


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_map_is_torchaos(signed):
    assert torch.equal(dynamic_map(signed), torch.tensor(create_dynamic_map(signed), dtype=torch.float32))


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_and_scales_are_torchaos_and_decode_within_the_map_spacing(signed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2048, generator=gen) * torch.logspace(-4, 1, 2048)
    x = x if signed else x.abs()
    codes, absmax = encode_int8(x, signed)
    scaled, scale = scale_tensor(x.reshape(-1), 256)
    assert torch.equal(codes.reshape(-1), quantize_8bit_with_qmap(scaled, torch.tensor(create_dynamic_map(signed))))
    assert torch.equal(absmax.reshape(-1), scale)
    back = decode_int8(codes, absmax, signed)
    qmap = dynamic_map(signed)
    half_gap = float((qmap[1:] - qmap[:-1]).max()) / 2  # the coarsest spacing, at the top (−1 itself has no code)
    blocks = absmax.repeat_interleave(256, dim=1)
    assert ((back - x).abs() <= half_gap * (1 + 1e-4) * blocks).all()


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_table_gives_bucketizes_nearest_code_for_every_float(signed):
    """nearest_codes reads a table by a float's 17 high bits: every such bin (all 2^17, ends taken
    exactly) spans at most one midpoint of the map, and its codes equal a binary search's on
    random values over twelve decades, every code and midpoint and their neighbouring floats,
    signed zeros, ±∞ and NaN."""
    mids = (dynamic_map(signed)[1:] + dynamic_map(signed)[:-1]) / 2
    high = (torch.arange(1 << 17, dtype=torch.int64) - (1 << 16)).to(torch.int32) << 15
    ends = torch.stack([high.view(torch.float32), (high | 0x7FFF).view(torch.float32)])
    ends = ends[:, ends.isfinite().all(0)]
    span = torch.bucketize(ends, mids, right=True)
    assert int((span[0] - span[1]).abs().max()) == 1
    gen = torch.Generator().manual_seed(0)
    q = dynamic_map(signed)
    x = torch.cat([torch.rand(1 << 18, generator=gen) * 2 - 1,
                   (torch.rand(1 << 16, generator=gen) - 0.5) * 10 ** (-12 * torch.rand(1 << 16, generator=gen)),
                   q, -q, mids, -mids, *(torch.nextafter(v, torch.tensor(d)) for v in (q, mids) for d in (-2.0, 2.0)),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, -3.0, float("inf"), -float("inf"), float("nan")])])
    assert torch.equal(nearest_codes(x, signed), torch.bucketize(x, mids, right=True).to(torch.int32))


def test_int8_adam_matches_torchaos_adamw8bit_far_closer_than_either_matches_float32():
    torch.manual_seed(0)
    w0 = torch.randn(256, 512) * 0.02
    grads = [torch.randn(256, 512) * 1e-2 for _ in range(20)]

    def run(make):
        p = torch.nn.Parameter(w0.clone())
        opt = make([p])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    adam = {"kind": "adam", "betas": [0.9, 0.999], "eps": 1e-8}
    ours = run(lambda ps: geomopt.GeomOptimizer([("w", ps[0])], {**_spec("int8", adam)}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run(lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.0, block_size=256))
    full = run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0))
    moved = (full - w0).norm()
    assert (ours - theirs).norm() / moved < 1e-3  # measured 9.6e-5 (their op order in float32)
    assert (theirs - full).norm() / moved > 1e-2  # what 8 bits cost: 1.6e-2


def bits(x: torch.Tensor, seed: int) -> torch.Tensor:
    return noise(torch.tensor([seed]), (1, *x.shape))[0]


def test_the_rounding_noise_is_uniform_and_follows_the_entry_not_the_shard():
    """16-bit draws: mean and spread of a uniform on [0, 2¹⁶), low lag-1 correlation; and a block
    of a (6, 10) tensor draws what the whole tensor draws at those entries."""
    r = noise(torch.tensor([7, 8]), (2, 400, 500)).double()
    assert r.min() >= 0 and r.max() < 2 ** 16
    assert abs(float(r.mean()) / 2 ** 16 - 0.5) < 0.005 and abs(float(r.std()) / 2 ** 16 - 12 ** -0.5) < 0.005
    flat = r[0].reshape(-1) - r[0].mean()
    assert abs(float((flat[1:] * flat[:-1]).mean() / flat.var())) < 0.01
    assert not torch.equal(r[0], r[1])
    # the hash in int32 (products wrapping mod 2³²) is the same integer function computed in int64
    seeds = torch.tensor([7, 2 ** 32 - 5])
    n = 64 * 32
    pos = torch.arange(2 * n)
    x = ((pos % n) ^ seeds[pos // n]) & 0xFFFFFFFF
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    assert torch.equal(noise(seeds, (2, 64, 32)).long().reshape(-1), ((x >> 16) ^ x) & 0xFFFF)
    whole = noise(torch.tensor([3]), (1, 6, 10))
    assert torch.equal(noise(torch.tensor([3]), (1, 2, 5), start=(4, 5), full=(6, 10)), whole[:, 4:6, 5:10])
    assert torch.equal(noise(torch.tensor([3]), (1, 2, 10), start=(4, 0), full=(6, 10)), whole[:, 4:6])


def test_bf16_stochastic_rounding_is_unbiased_between_the_two_neighbours_and_seeded():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # a quarter of the way from 1 to the next bf16 (1 + 2⁻⁷·…)
    x = torch.tensor([1.0, 1.0 + 2 ** -9, 3.3e-3, -7.77]).repeat_interleave(50_000)
    out = encode_bf16(x, bits(x, 0)).float()
    down = x.to(torch.bfloat16).float()  # round to nearest: one of the two neighbours
    lo = torch.minimum(down, torch.nextafter(down, -x.sign() * float("inf")))
    for v in x.unique():
        sel = x == v
        got = out[sel]
        assert got.unique().numel() <= 2
        spacing = (got.max() - got.min()).clamp(min=1e-30)
        # mean of 50k Bernoulli draws: within 4.5 standard errors of the exact value
        assert abs(got.double().mean() - float(v)) <= 4.5 * float(spacing) * 0.5 / 50_000 ** 0.5 + 1e-12
    assert torch.equal(out, encode_bf16(x, bits(x, 0)).float())
    assert not torch.equal(out, encode_bf16(x, bits(x, 1)).float())
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    assert torch.equal(encode_bf16(special, None).float()[:2], special[:2]) and encode_bf16(special, None)[2].isnan()
    assert lo.numel() == x.numel()


@pytest.mark.parametrize("geometry, direction, bounds", [
    ({"kind": "adam"}, None, {"bfloat16": 0.03, "int8": 0.1, "int8-ec": 0.02}),
    ({"kind": "euclidean"}, {"kind": "polyak", "alpha": 0.1}, {"bfloat16": 0.03, "int8": 0.06, "int8-ec": 0.01}),
    (SPECTRAL, {"kind": "polyak", "alpha": 0.1}, {"bfloat16": 0.3, "int8": 0.7, "int8-ec": 0.2}),
], ids=["adam", "polyak-sgd", "muon"])
def test_each_precision_tracks_float32_over_200_steps(geometry, direction, bounds):
    """Iterates against float32 state, relative to how far float32 moved them (Newton–Schulz maps
    every singular value of the momentum near 1, so the small ones' rounding moves the update: a
    larger bound for muon), and the last 20 losses' mean within 1e-3. int8-ec's corrections hold it
    closer than int8 and than bf16 (measured 0.0059, 0.0023, 0.086; int8: 0.049, 0.026, 0.46)."""
    models = {d: tiny_gpt(0) for d in ("float32", *bounds)}
    opts = {d: geomopt.GeomOptimizer(m, _spec(d, geometry, direction)) for d, m in models.items()}
    start = [p.detach().clone() for p in models["float32"].parameters()]
    losses: dict = {d: [] for d in models}
    for step in range(200):
        for d, m in models.items():
            for p in m.parameters():
                p.grad = None
            loss = loss_of(m, gpt_batch(step))
            loss.backward()
            losses[d].append(float(loss))
            opts[d].step()
    ref = list(models["float32"].parameters())
    for d, bound in bounds.items():
        dev = max(float((p - q).norm() / (q - x).norm()) for p, q, x in zip(models[d].parameters(), ref, start))
        assert dev <= bound, (d, dev)
        assert abs(sum(losses[d][-20:]) - sum(losses["float32"][-20:])) / 20 < 1e-3, d


def _held(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def test_state_bytes_bf16_about_half_and_int8_about_a_quarter():
    """On tensors whose sizes are multiples of 256 (a size that is not keeps float32 state); int8-ec
    adds half a byte per entry (its 4-bit corrections): (1 + 1/2 + 4/256) / 4 = 0.379."""
    params = [(f"w{i}", torch.nn.Parameter(torch.randn(256, 128))) for i in range(3)]
    held = {}
    for dtype in ("float32", "bfloat16", "int8", "int8-ec"):
        ps = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
        opt = geomopt.GeomOptimizer(ps, _spec(dtype, {"kind": "adam"}))
        for _, p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        held[dtype] = _held(opt)
    assert held["bfloat16"] / held["float32"] <= 0.55
    assert held["int8"] / held["float32"] <= 0.30  # codes 1/4 + one float32 scale per 256 entries
    assert held["int8-ec"] - held["int8"] == 2 * 3 * 256 * 128 // 2  # two moments, half a byte per entry
    assert held["int8-ec"] / held["float32"] <= 0.38


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int8-ec"])
def test_a_checkpoint_resumes_bit_for_bit_and_records_its_precision(dtype):
    spec = _spec(dtype, SPECTRAL, {"kind": "polyak", "alpha": 0.1})
    model = tiny_gpt(0)
    opt = geomopt.GeomOptimizer(model, spec)
    for k in range(3):
        for p in model.parameters():
            p.grad = None
        loss_of(model, gpt_batch(k)).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    kinds = {v.dtype for st in sd["state"].values() for k, v in st.items() if torch.is_tensor(v) and k != "d" + SCALE}
    assert (torch.bfloat16 if dtype == "bfloat16" else torch.uint8) in kinds
    fixes = [st["d" + CORRECTION] for st in sd["state"].values() if "d" + CORRECTION in st]
    assert len(fixes) == (4 if dtype == "int8-ec" else 0)  # the hidden matrices' momentum
    assert all(f.dtype == torch.uint8 and f.numel() * 2 == st.numel() for f, st in
               zip(fixes, [st["d"] for st in sd["state"].values() if "d" + CORRECTION in st]))
    twin = copy.deepcopy(model)
    resumed = geomopt.GeomOptimizer(twin, spec)
    resumed.load_state_dict(sd)
    for m, o in ((model, opt), (twin, resumed)):
        for p in m.parameters():
            p.grad = None
        loss_of(m, gpt_batch(3)).backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_int8_scales_take_the_tensors_shape_and_flat_ones_still_load():
    """A (6, 512) tensor's scales are (6, 2): a block of 256 per row half (a shard cut at a
    multiple of 256 holds whole blocks); a checkpoint with them flat, one per block of the flattened
    tensor, loads and resumes the same."""
    def make():
        torch.manual_seed(0)
        ps = [("w", torch.nn.Parameter(torch.randn(6, 512))), ("v", torch.nn.Parameter(torch.randn(3, 256)))]
        return ps, geomopt.GeomOptimizer(ps, _spec("int8", {"kind": "adam"}))

    grads = [torch.randn(6, 512, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    (ps, opt), (ps2, opt2) = make(), make()
    for g in grads[:2]:
        for _, p in ps:
            p.grad = g[: p.shape[0], : p.shape[1]].clone()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["exp_avg" + SCALE].shape == (6, 2) and sd["state"][1]["exp_avg" + SCALE].shape == (3, 1)
    for st in sd["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            st[key + SCALE] = st[key + SCALE].reshape(-1)
    with torch.no_grad():
        for (_, p), (_, q) in zip(ps, ps2):
            q.copy_(p)
    opt2.load_state_dict(sd)
    for (_, p), (_, q) in zip(ps, ps2):
        p.grad = grads[2][: p.shape[0], : p.shape[1]].clone()
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(ps, ps2))


@pytest.mark.parametrize("dtype", ["int8", "int8-ec"])
def test_a_checkpoint_moves_between_precisions_with_the_migration(dtype):
    """int8 state into a float32 spec: decoded (within the map's spacing), reported as kept."""
    model = tiny_gpt(0)
    geometry = {"kind": "adam"}
    low = geomopt.GeomOptimizer(model, _spec(dtype, geometry))
    for k in range(2):
        for p in model.parameters():
            p.grad = None
        loss_of(model, gpt_batch(k)).backward()
        low.step()
    twin = copy.deepcopy(model)
    full = geomopt.GeomOptimizer(twin, _spec("float32", geometry))
    report = full.load_state_dict(copy.deepcopy(low.state_dict()), allow_spec_change=True)
    assert report is not None and "adam" in str(report)
    quantized = 0
    for p, q in zip(model.parameters(), twin.parameters()):
        st, st2 = low.state[p], full.state[q]
        assert st2["exp_avg"].dtype == torch.float32 and "exp_avg" + SCALE not in st2
        assert "exp_avg" + CORRECTION not in st2
        if st["exp_avg"].dtype == torch.uint8:  # quantized there: decoded here
            codes, scales = st["exp_avg"].unsqueeze(0), st["exp_avg" + SCALE].unsqueeze(0)
            back = (decode_int8(codes, scales, True) if dtype == "int8" else
                    decode_int8_ec(codes, unpack4(st["exp_avg" + CORRECTION]).reshape(codes.shape), scales, True))[0]
            assert torch.equal(back, st2["exp_avg"])
            quantized += 1
    assert quantized >= 4  # the matrices (a bias of 16 entries keeps float32)


@pytest.mark.parametrize("dtype", ["int8", "int8-ec"])
def test_int8_state_for_a_storm_direction_is_refused_at_the_key(tmp_path, dtype):
    path = tmp_path / "s.yaml"
    path.write_text("\n".join(["geomopt: 1", "name: s", "rules:", "  - name: all", "    match: \"**\"",
                               "    geometry: {kind: euclidean}", "    direction: {kind: storm}",
                               f"    state: {dtype}"]))
    with pytest.raises(ValueError, match=r"s.yaml:8:12.*GO127.*accepts: float32, bfloat16"):
        geomopt.GeomOptimizer(tiny_gpt(0), str(path))


def test_a_capturable_step_refuses_low_precision_state():
    with pytest.raises(ValueError, match="keeps its state in bfloat16"):
        geomopt.GeomOptimizer(tiny_gpt(0), _spec("bfloat16", {"kind": "adam"}), capturable=True)


def test_the_program_says_an_encoded_elementwise_rule_steps_flat_chunk_by_chunk():
    opt = geomopt.GeomOptimizer(tiny_gpt(0), _spec("int8", {"kind": "adam"}))
    assert "state int8: the moments decoded chunk by chunk into the workspace" in opt.describe()


def test_the_dynamic_map_has_the_same_bits_on_every_cpu_kernel():
    """The map is made in exact integer arithmetic, not by torch.linspace (whose scalar kernel
    rounds 42 signed and 31 unsigned points an ulp apart from the vectorized one): a process
    restricted to ATen's scalar CPU kernels makes the same 2 × 256 bits, so a checkpoint's codes
    decode alike on every machine."""
    import subprocess
    import sys
    code = ("import torch; from geomopt.optim.persist.codes import dynamic_map; "
            "print(','.join(str(int(v)) for s in (True, False) for v in dynamic_map(s).view(torch.int32)))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = [int(v) for s in (True, False) for v in dynamic_map(s).view(torch.int32)]
    assert [int(v) for v in out.strip().split(",")] == here
    scalar = subprocess.run([sys.executable, "-c", "import torch; print(torch.linspace(0.1, 1, 65).view(torch.int32)"
                             ".tolist())"], env=env, capture_output=True, text=True, check=True).stdout
    vector = torch.linspace(0.1, 1, 65).view(torch.int32).tolist()
    assert str(vector) != scalar.strip()  # the kernels do differ: the test could tell them apart
