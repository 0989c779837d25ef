"""Compensated bfloat16 weights (a rule's ``state: {compensation: int8|int16}``): the split and join
against their definitions (bit patterns, a float64 reference), then the optimizer on a bf16 model
against the same spec on float32 weights fed the same gradients, checkpoints, the non-finite skip,
refusals, migration, autocast and the bytes a parameter costs; under DDP, FSDP2 and FSDP2 × TP
(torchrun workers)."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import geomopt
from geomopt.models import GPT, GPTConfig
from geomopt.optim import CheckpointError
from geomopt.optim.units.compensation import join8, join16, split8, split16

BF16 = torch.bfloat16


# ---------------------------------------------------------------- the arithmetic


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=64))
def test_split16_is_exact_and_rounds_to_nearest(bits):
    """join16(split16(x)) is x bit for bit (infinities, subnormals, −0 included; a NaN stays a NaN);
    the weight is x rounded to the nearest bf16 (bf16's own rounding but at exact ties, which go up
    in magnitude), with x's sign."""
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    w, low = split16(x)
    assert w.dtype == BF16 and low.dtype == torch.int16
    back = join16(w, low)
    nan = torch.isnan(x)
    assert torch.equal(back.view(torch.int32)[~nan], x.view(torch.int32)[~nan])
    assert torch.isnan(back[nan]).all() and torch.isnan(w[nan]).all()
    for v, wv, b in zip(x.tolist(), w.float().tolist(), bits):
        if math.isnan(v):
            continue
        assert math.copysign(1.0, wv) == math.copysign(1.0, v)
        tie = (b & 0xFFFF) == 0x8000  # half-way between two bf16 values
        assert wv == float(torch.tensor(v).to(BF16).float()) or (tie and abs(wv) >= abs(v))


def _reference8(x: float) -> tuple[float, int]:
    """(w, q) in float64 from the definition: w = x rounded to 8 significant bits (nearest, ties to
    even, as bf16), ulp(w) = 2^(e−8) for w = m·2^e, q = round((x − w)·256/ulp(w)) clamped to ±127."""
    w = float(torch.tensor(x, dtype=torch.float32).to(BF16).float())
    e = math.frexp(w)[1]
    q = round((x - w) * 256 / 2.0 ** (e - 8))
    return w, max(-127, min(127, q))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, width=32), min_size=1, max_size=32))
def test_split8_against_a_float64_reference(values):
    """In bf16's normal range (|x| ≥ 2^−100 here, or 0): the reference's w and q, |x̂ − x| ≤ ulp/256."""
    values = [v if abs(v) >= 2.0 ** -100 or v == 0 else 2.0 ** -100 for v in values]
    x = torch.tensor(values, dtype=torch.float32)
    w, q = split8(x)
    ref = [_reference8(v) for v in values]
    assert w.float().tolist() == [r[0] for r in ref]
    # the float64 reference rounds halves to even, split8's round() too; they agree everywhere
    assert q.tolist() == [r[1] for r in ref]
    back = join8(w, q)
    for v, y, (wr, _) in zip(values, back.tolist(), ref):
        ulp = 2.0 ** (math.frexp(wr)[1] - 8) if wr else 2.0 ** -133
        assert abs(y - v) <= ulp / 256
    w2, q2 = split8(back)  # decoding, then encoding, gives the same bits
    assert torch.equal(w2.view(torch.int16), w.view(torch.int16)) and torch.equal(q2, q)


def test_compensation_keeps_updates_bf16_rounds_away():
    """1 + 1000·δ with δ = 1e-4 (below half of bf16's spacing 2^−7 at 1): plain bf16 stays at 1;
    int16 gives the float32 sum bit for bit; int8 within 1000 × its resolution ulp/512."""
    delta = torch.tensor([1e-4])
    plain = torch.ones(1, dtype=BF16)
    x32 = torch.ones(1)
    w16, low = split16(torch.ones(1))
    w8, q = split8(torch.ones(1))
    for _ in range(1000):
        plain = (plain.float() + delta).to(BF16)
        x32 = x32 + delta
        w16, low = split16(join16(w16, low) + delta)
        w8, q = split8(join8(w8, q) + delta)
    assert plain.item() == 1.0
    assert torch.equal(join16(w16, low), x32)
    assert abs(join8(w8, q).item() - x32.item()) <= 1000 * 2.0 ** -7 / 512
    assert abs(join8(w8, q).item() - 1.1) < 0.01


def _bits(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32).view(torch.float32)


#: float32 bit patterns at the edges: ±0, ±∞, a NaN, the smallest subnormal, the largest finite
#: (which rounds to ∞ in bf16), ties just below, at and above half a bf16 spacing, a tie carrying
#: into the next binade, 1, −1.5
EDGES = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x00000001, 0x7F7FFFFF, 0x3F807FFF,
         0x3F808000, 0x3F808001, 0x3F818000, 0x3FFF8000, 0xBF7F8000, 0x3F800000, 0xBFC00000]


def test_split16_join16_at_the_edges():
    """split16 on :data:`EDGES` against the definition in Python integers (w's bits: the magnitude
    plus 2^15, its low 16 bits cleared; the remainder the magnitude minus that, NaN kept as bf16's
    quiet NaN with remainder 0), and join16 giving every non-NaN pattern back bit for bit."""
    x = _bits(EDGES)
    w, low = split16(x)
    for b, wv, lv in zip(EDGES, w.view(torch.int16).tolist(), low.tolist()):
        sign, mag = b & 0x80000000, b & 0x7FFFFFFF
        wmag = 0x7FC00000 if mag > 0x7F800000 else (mag + 0x8000) & ~0xFFFF
        rest = 0 if mag > 0x7F800000 else mag - wmag
        assert wv & 0xFFFF == (sign | wmag) >> 16 and lv == rest, hex(b)
    back = join16(w, low).view(torch.int32)
    for b, v in zip(EDGES, back.tolist()):
        if not (b & 0x7FFFFFFF) > 0x7F800000:
            assert v & 0xFFFFFFFF == b, hex(b)


def test_split8_join8_at_the_edges():
    """split8 at a binade's edges, a tie of bf16 (q = ±128 clamped to ±127) and ±0 against the
    float64 reference (:func:`_reference8`); join8 keeps −0's sign and reads w + q·ulp(w)/256."""
    values = [1.0, -1.0, 1.0 + 2.0**-8, 1.0 + 2.0**-8 + 2.0**-16, 1.0 - 2.0**-24, 2.0 - 2.0**-9,
              0.75 + 3 * 2.0**-20, -(3.0 + 2.0**-7), 2.0**-100 * 1.5, 1e30]
    x = torch.tensor(values, dtype=torch.float32)
    w, q = split8(x)
    ref = [_reference8(float(v)) for v in x.tolist()]
    assert w.float().tolist() == [r[0] for r in ref]
    assert q.tolist() == [r[1] for r in ref]
    assert 127 in [abs(v) for v in q.tolist()]  # the tie, clamped
    back = join8(w, q).tolist()
    for (wr, qr), y in zip(ref, back):
        e = math.frexp(wr)[1]
        assert y == wr + qr * 2.0 ** (e - 16)
    zw, zq = split8(torch.tensor([-0.0, 0.0]))
    assert zq.tolist() == [0, 0]
    assert [math.copysign(1.0, v) for v in join8(zw, zq).tolist()] == [-1.0, 1.0]


# ---------------------------------------------------------------- the optimizer


def _gpt(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    return model.to(dtype)


def _spec(name: str, compensation: str, state: str = "float32", lr_scale: float = 1.0) -> geomopt.Spec:
    """A shipped spec with every rule's state precision and compensation set."""
    data = geomopt.load_spec(name).model_dump(exclude_none=True)
    st_ = {"dtype": state} if compensation == "none" else {"dtype": state, "compensation": compensation}
    data["defaults"] = dict(data.get("defaults") or {}, state=st_)
    for rule in data["rules"]:
        rule.pop("state", None)
        if lr_scale != 1.0:
            rule["lr"] = rule.get("lr", data["defaults"].get("lr", 0.02)) * lr_scale
    return geomopt.Spec.model_validate(data)


def _pair(name: str, compensation: str, state: str = "float32", lr_scale: float = 1.0):
    """A bf16 GPT with the compensated spec, and a float32 GPT holding the same (bf16) weights with
    the spec as it ships (float32 weights: what compensation stands in for)."""
    m16 = _gpt(BF16)
    m32 = _gpt(BF16).float()
    o16 = geomopt.GeomOptimizer(m16, _spec(name, compensation, state, lr_scale))
    o32 = geomopt.GeomOptimizer(m32, _spec(name, "none", state, lr_scale))
    return m16, o16, m32, o32


def _same_grads(m16, m32, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p16, p32 in zip(m16.parameters(), m32.parameters()):
        grad = torch.randn(p16.shape, generator=g).to(BF16)
        p16.grad, p32.grad = grad, grad.float()


def _weights(model, opt, join) -> list[torch.Tensor]:
    return [join(p.detach(), opt.state[p]["weight_error"]) for p in model.parameters()]


SPECS = ("muon", "adamw-hybrid", "hyperball", "normalized-sgd")


@pytest.mark.parametrize("name", SPECS)
def test_int16_steps_the_float32_weights_bit_for_bit(name):
    """int16 keeps the float32 weight exactly: a bf16 model steps as the float32 one, every bit, on
    flat (fused AdamW), batched (Newton–Schulz) and constrained rules; the parameter is the float32
    weight rounded to bf16, and keeps its dtype and its own gradient."""
    m16, o16, m32, o32 = _pair(name, "int16")
    for step in range(4):
        _same_grads(m16, m32, step)
        grads = [p.grad for p in m16.parameters()]
        o16.step()
        o32.step()
        assert all(p.grad is g and p.dtype == BF16 for p, g in zip(m16.parameters(), grads))
    for x, p32, p16 in zip(_weights(m16, o16, join16), m32.parameters(), m16.parameters()):
        assert torch.equal(x, p32.detach())
        assert torch.equal(p16.detach().view(torch.int16), split16(p32.detach())[0].view(torch.int16))
        assert (p16.detach().float() - p32.detach()).abs().max() <= p32.detach().abs().max() * 2.0 ** -8


@pytest.mark.parametrize("name", ["muon", "adamw-hybrid"])
def test_int8_tracks_the_float32_weights_bf16_does_not(name):
    """At a small lr (updates near bf16's spacing), on the same gradients: int8's weights stay within
    what its rounding allows, one ulp/512 ≤ |w|·2^−16 a step, of the float32 weights; plain bf16
    weights (no compensation) drift 20× further."""
    steps = 8
    m16, o16, m32, o32 = _pair(name, "int8", lr_scale=0.05)
    plain = _gpt(BF16)
    op = geomopt.GeomOptimizer(plain, _spec(name, "none", lr_scale=0.05))
    for step in range(steps):
        _same_grads(m16, m32, step)
        for q, p in zip(plain.parameters(), m16.parameters()):
            q.grad = p.grad.clone()
        o16.step(), o32.step(), op.step()
    total8 = total_bf16 = 0.0
    for x, q, p in zip(_weights(m16, o16, join8), plain.parameters(), m32.parameters()):
        ref = p.detach()
        assert (x - ref).abs().max() <= steps * ref.abs().max() * 2.0 ** -16
        total8 += float((x - ref).norm() ** 2)
        total_bf16 += float((q.detach().float() - ref).norm() ** 2)
    assert total8 > 0 and total_bf16 >= 400 * total8


def test_describe_says_the_step_runs_on_float32_weights():
    m16, o16, _, _ = _pair("muon", "int8")
    text = o16.describe()
    assert "bfloat16" not in text.split("why:")[0] or "torch.float32" in text
    assert "compensation int8" in text


def test_checkpoint_resumes_bit_for_bit():
    """The error is state: saved, loaded into a fresh optimizer on a copy of the model, and the two
    runs go on with the same bits."""
    m16, o16, m32, _ = _pair("muon", "int8", state="bfloat16")
    for step in range(3):
        _same_grads(m16, m32, step)
        o16.step()
    sd = copy.deepcopy(o16.state_dict())
    twin = copy.deepcopy(m16)
    o2 = geomopt.GeomOptimizer(twin, _spec("muon", "int8", state="bfloat16"))
    o2.load_state_dict(sd)
    for step in range(3, 6):
        _same_grads(m16, m32, step)
        for q, p in zip(twin.parameters(), m16.parameters()):
            q.grad = p.grad.clone()
        o16.step()
        o2.step()
    for p, q in zip(m16.parameters(), twin.parameters()):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
        assert torch.equal(o16.state[p]["weight_error"], o2.state[q]["weight_error"])


def test_load_refuses_an_error_of_another_compensation():
    m16, o16, m32, _ = _pair("adamw-hybrid", "int8")
    _same_grads(m16, m32, 0)
    o16.step()
    sd = copy.deepcopy(o16.state_dict())
    entry = next(e for e in sd["state"].values() if "weight_error" in e)
    entry["weight_error"] = entry["weight_error"].to(torch.int16)  # as an int16 rule keeps it
    o2 = geomopt.GeomOptimizer(copy.deepcopy(m16), _spec("adamw-hybrid", "int8"))
    with pytest.raises(CheckpointError, match="'weight_error' is torch.int16 .* keeps torch.int8"):
        o2.load_state_dict(sd)
    entry["weight_error"] = entry["weight_error"].float()
    with pytest.raises(CheckpointError, match="'weight_error' is torch.float32 .* keeps torch.int8"):
        o2.load_state_dict(sd)


def test_migration_carries_the_error_of_the_same_form_only():
    """A spec change keeps the error where the new rule keeps the same form, resets it otherwise."""
    m16, o16, m32, _ = _pair("adamw-hybrid", "int8")
    _same_grads(m16, m32, 0)
    o16.step()
    sd = o16.state_dict()
    same = geomopt.GeomOptimizer(copy.deepcopy(m16), _spec("adamw-hybrid", "int8", lr_scale=0.5))
    report = same.load_state_dict(sd, allow_spec_change=True)
    name = next(iter(report.kept))
    assert "compensation" in report.kept[name]
    p0 = next(iter(same.state))
    assert same.state[p0]["weight_error"].dtype == torch.int8
    other = geomopt.GeomOptimizer(copy.deepcopy(m16), _spec("adamw-hybrid", "int16", lr_scale=0.5))
    report = other.load_state_dict(sd, allow_spec_change=True)
    assert any("compensation" in r for r in report.reset[name])


def test_a_skipped_step_changes_nothing():
    """A non-finite gradient: the bf16 weights, their errors and every state tensor keep their bits,
    and each parameter keeps its own gradient."""
    m16, o16, m32, _ = _pair("muon", "int8")
    _same_grads(m16, m32, 0)
    o16.step()
    before = {k: v.clone() for p in m16.parameters() for k, v in ((id(p), p.detach()),)}
    state = copy.deepcopy({id(p): dict(s) for p, s in o16.state.items()})
    _same_grads(m16, m32, 1)
    next(iter(m16.parameters())).grad[0] = float("nan")
    grads = [p.grad for p in m16.parameters()]
    o16.step()
    for p, g in zip(m16.parameters(), grads):
        assert p.grad is g and p.dtype == BF16
        assert torch.equal(p.detach().view(torch.int16), before[id(p)].view(torch.int16))
        for k, v in state[id(p)].items():
            got = o16.state[p][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v


def test_refusals_say_what_to_do():
    with pytest.raises(ValueError, match="all float32, which lose nothing"):
        geomopt.GeomOptimizer(_gpt(), _spec("muon", "int8"))
    half = _gpt(BF16)
    half.lm_head.weight.data = half.lm_head.weight.data.half()
    with pytest.raises(ValueError, match="float16: cast it to bfloat16"):
        geomopt.GeomOptimizer(half, _spec("adamw-hybrid", "int8"))
    with pytest.raises(ValueError, match="compensation int8"):
        geomopt.GeomOptimizer(_gpt(BF16), _spec("adamw-hybrid", "int8"), capturable=True)


def test_dsl_says_it_and_prints_it():
    text = ("geomopt 1\nname \"c\"\n\nrule all match \"**\":\n    geometry adam\n"
            "    state bfloat16(compensation=int8)\n")
    spec = geomopt.parse_spec(text, "dsl")
    assert spec.rules[0].state.dtype == "bfloat16" and spec.rules[0].state.compensation == "int8"
    printed = geomopt.dump_spec(spec, "dsl")
    assert "state bfloat16(compensation=int8)" in printed or "state=bfloat16(compensation=int8)" in printed
    again = geomopt.parse_spec(printed, "dsl")
    assert again.rules[0].state == spec.rules[0].state


def test_autocast_forward_and_a_step():
    """A bf16 model under autocast: the forward, backward and step run, the weights stay bf16 and
    move, and the error is kept."""
    model = _gpt(BF16)
    opt = geomopt.GeomOptimizer(model, _spec("muon", "int8", state="bfloat16"))
    x = torch.randint(0, 32, (4, 8))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=BF16):
        logits, loss = model(x, x)
    loss.backward()
    opt.step()
    assert all(p.dtype == BF16 for p in model.parameters())
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(opt.state[p]["weight_error"].dtype == torch.int8 for p in model.parameters())


def _bytes(model, opt, params) -> float:
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(v.numel() * v.element_size() for p in params for v in opt.state[p].values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return held / sum(p.numel() for p in params)


def test_bytes_per_parameter():
    """Weights + optimizer state held after a step, per parameter: an Adam rule in bf16 state with
    int8 compensation 2 + 1 + 2 + 2 = 7 bytes; a Muon rule (bf16 momentum) 2 + 1 + 2 = 5."""
    m16, o16, m32, _ = _pair("muon", "int8", state="bfloat16")
    _same_grads(m16, m32, 0)
    o16.step()
    by_rule: dict = {}
    for g in o16.param_groups:
        by_rule[g["rule"]] = g["params"]
    assert _bytes(m16, o16, by_rule["hidden"]) == 5
    adam = [p for r, ps in by_rule.items() if r != "hidden" for p in ps]
    assert _bytes(m16, o16, adam) == 7


# ---------------------------------------------------------------- torch.distributed


#: torchrun: one pytest-xdist worker runs every test that starts gloo processes, one launch after another
#: (tests/conftest.py); these tests share its module fixtures' launches
TORCHRUN = pytest.mark.xdist_group("torchrun")


def _launch(tmp_path_factory, worker: str) -> list:
    sys.path.insert(0, str(Path(__file__).parent))
    import layout_worker

    return layout_worker.launch(4, tmp_path_factory.mktemp(worker), script=str(Path(__file__).parent / f"{worker}.py"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """4 gloo processes (tests/compensation_worker.py): DDP pairs against one process."""
    return _launch(tmp_path_factory, "compensation_worker")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """4 gloo processes (tests/compensation_fsdp_worker.py): FSDP2 on two meshes of 2 ranks
    (``fsdp``), HSDP on a 2 × 2 mesh (``hsdp``) and FSDP2 × TP on a 2 × 2 mesh (``fsdp_tp``), bf16
    parameters."""
    return _launch(tmp_path_factory, "compensation_fsdp_worker")


@TORCHRUN
def test_ddp_steps_compensated_weights_as_one_process(ranks):
    """Under DDP every rank's bf16 weights and decoded float32 weights equal one process's bit for
    bit, a forward after the steps gives its loss, and every parameter keeps its error."""
    for r in ranks:
        for (layout, name), dev in r["deviation"].items():
            assert dev == {"bf16": 0.0, "float32": 0.0}, (r["rank"], layout, name, dev)
            assert r["loss"][(layout, name)] == r["loss"][("single", name)]
            form = name.rsplit("-", 1)[1]
            assert len(r["errors"][(layout, name)]) == 21
            assert all(e == (f"torch.{form}", "torch.bfloat16") for e in r["errors"][(layout, name)].values())


def _sharded_runs(ranks: list, form: str) -> list:
    runs = [(r["rank"], key, got) for r in ranks for key, got in r["against_float32"].items() if key[2] == form]
    assert {key[:2] for _, key, _ in runs} == {(lay, base) for lay in ("fsdp", "hsdp", "fsdp_tp")
                                              for base in ("muon", "adamw-hybrid")}
    return runs


@TORCHRUN
def test_sharded_int16_steps_the_float32_weights_bit_for_bit(sharded):
    """Under FSDP2, HSDP and FSDP2 × TP, bf16 parameters with int16 compensation step as float32
    parameters under the same spec, fed the same gradients: every rank's decoded shards equal the
    float32 model's bit for bit; the parameters stay bf16, every error is a DTensor placed like its
    parameter (one entry per local element). FSDP2's forward after the steps gathers the written
    shards: its loss is one process's on the gathered bf16 weights, exactly (FSDP2) or up to the
    split matmuls' rounding (TP: 1e-3)."""
    for rank, key, got in _sharded_runs(sharded, "int16"):
        assert got["bits"] and got["dev"] == 0.0 and got["bf16"] and got["sharded"], (rank, key, got)
        if key[0] != "fsdp_tp":
            assert got["loss"] == got["one_process"], (rank, key, got)
        else:
            assert abs(got["loss"] - got["one_process"]) <= 1e-3, (rank, key, got)


@TORCHRUN
def test_sharded_int8_stays_within_its_bound(sharded):
    """int8 under FSDP2, HSDP and FSDP2 × TP: every rank's decoded shards within STEPS · max|x| · 2^−16
    of the float32 model's (what one step's rounding, ulp/512 ≤ |w|·2^−16, allows), and not equal."""
    for rank, key, got in _sharded_runs(sharded, "int8"):
        assert 0.0 < got["dev"] <= 1.0 and got["bf16"] and got["sharded"], (rank, key, got)


@TORCHRUN
def test_sharded_checkpoint_resumes_bit_for_bit(sharded):
    """opt.state_dict() into a fresh optimizer and a distributed checkpoint (DCP's get_state_dict,
    save, load, set_state_dict) resume with the same bits of every bf16 weight and every error; a
    spec change (``allow_spec_change``) carries every error, a DTensor placed like its parameter."""
    for r in sharded:
        for layout, got in r["checkpoints"].items():
            assert got == dict(state_dict=True, dcp=True, keys=42, carried=True, moved=21), (r["rank"], layout, got)


@TORCHRUN
def test_sharded_nonfinite_step_changes_nothing(sharded):
    """A NaN in one rank's shard of a hidden matrix's gradient: every rank skips the step (the
    hidden rule counts it), no bit of a weight's shard or an error moves, gradients stay the
    parameters' own."""
    for r in sharded:
        for layout, got in r["nonfinite"].items():
            assert got["unchanged"] and got["own_grads"], (r["rank"], layout, got)
            assert got["skipped"] == {"embeddings": 0, "head": 0, "hidden": 1, "rest": 0}, (r["rank"], layout, got)
